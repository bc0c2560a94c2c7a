"""Startup's checks of the world a run meets (the top of the layers below the stages).

`preflight`: one function per check, `World` in, Problems out (the verifier, the
conversations, the split, the artifacts, the engines, memory, disk, credentials);
`machine`: what this machine has (GPU and CPU memory), read without torch. They read the
config, the plan, the data and engine modules; nothing below the stages imports them.
"""

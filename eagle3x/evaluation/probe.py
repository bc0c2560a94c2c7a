"""A vLLM worker extension that records what a served EAGLE-3 draft receives and returns.

Loaded into vLLM's worker processes through its supported extension point
(``LLM(worker_extension_cls="eagle3x.evaluation.probe.DraftProbe")``, mixed into the worker
class by ``vllm/v1/worker/worker_base.py``, ``WorkerWrapperBase.init_worker``) and driven
by ``LLM.collective_rpc``. While armed it records, call by call, on the drafter model that
vLLM's EAGLE proposer runs (``model_runner.drafter.model``, an ``Eagle3LlamaForCausalLM``
from ``vllm/model_executor/models/llama_eagle3.py``):

    fc_in / fc_out   the concatenated verifier aux hidden states and their projection
                     (``combine_hidden_states`` -> ``model.model.fc``)
    step_ids, step_positions, step_hidden
                     each draft forward: token ids, positions, and the pre-norm output
                     (``Eagle3LlamaForCausalLM.forward`` returns (normed, prenorm))
    logits           each ``compute_logits`` result, over the verifier vocabulary (the
                     draft logits scattered through d2t; -inf outside the draft vocabulary)

`take(path)` writes them to one safetensors file (tensors travel through a file, not
through vLLM's RPC serialisation) and clears the record. Nothing here changes what vLLM
computes. Only torch is imported; vLLM objects are reached through the worker.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch


class DraftProbe:
    """Mixed into vLLM's worker class: methods are called as ``collective_rpc(name, args)``."""

    def _eagle3x_drafter(self) -> Any:
        runner = getattr(self, "model_runner", None)
        drafter = getattr(runner, "drafter", None)
        model = getattr(drafter, "model", None)
        if model is None:
            raise RuntimeError("this vLLM worker runs no EAGLE drafter (no speculative_config?)")
        return model

    def eagle3x_probe_install(self) -> bool:
        """Hook the drafter once; recording starts disarmed."""
        if getattr(self, "_eagle3x_probe", None) is not None:
            return True
        model = self._eagle3x_drafter()
        record: Dict[str, List[torch.Tensor]] = {k: [] for k in (
            "fc_in", "fc_out", "step_ids", "step_positions", "step_hidden", "logits")}
        self._eagle3x_probe = {"armed": False, "record": record}
        state = self._eagle3x_probe

        def keep(name: str, t: Any) -> None:
            if state["armed"] and isinstance(t, torch.Tensor):
                record[name].append(t.detach().to("cpu", copy=True))

        def on_fc(_mod, args, out):
            keep("fc_in", args[0])
            keep("fc_out", out)

        def on_model(_mod, args, kwargs, out):
            names = ("input_ids", "positions", "hidden_states")
            given = dict(zip(names, args), **{k: v for k, v in kwargs.items() if k in names})
            keep("step_ids", given.get("input_ids"))
            keep("step_positions", given.get("positions"))
            keep("step_hidden", out[1] if isinstance(out, tuple) else out)

        model.model.fc.register_forward_hook(on_fc)
        # On the drafter itself: its inner LlamaModel is wrapped by vLLM's
        # support_torch_compile, whose __call__ bypasses nn.Module hooks.
        model.register_forward_hook(on_model, with_kwargs=True)
        compute_logits = model.compute_logits

        def logits_and_keep(hidden_states: torch.Tensor, *a: Any, **kw: Any) -> torch.Tensor:
            out = compute_logits(hidden_states, *a, **kw)
            keep("logits", out)
            return out

        model.compute_logits = logits_and_keep  # an instance attribute: this drafter only
        return True

    def eagle3x_probe_arm(self, armed: bool = True) -> bool:
        self.eagle3x_probe_install()
        self._eagle3x_probe["armed"] = bool(armed)
        if armed:
            for v in self._eagle3x_probe["record"].values():
                v.clear()
        return True

    def eagle3x_probe_take(self, path: str) -> Dict[str, int]:
        """Write the record to `path` (safetensors, name_<call>) and clear it; returns counts."""
        from safetensors.torch import save_file

        state = self._eagle3x_probe
        state["armed"] = False
        tensors = {f"{name}_{i}": t.contiguous() for name, ts in state["record"].items()
                   for i, t in enumerate(ts)}
        if getattr(self, "rank", 0) == 0:
            save_file(tensors, path)
        counts = {name: len(ts) for name, ts in state["record"].items()}
        for v in state["record"].values():
            v.clear()
        return counts

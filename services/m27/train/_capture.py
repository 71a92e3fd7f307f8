"""Walking the state into a snapshot, in two halves.

`capture_now` runs in `after_step` and takes what may change before the next optimizer
step: model buffers (the next forward updates BatchNorm statistics), the optimizer's
param_groups (a warm-up may set `lr` by hand), scheduler, scaler, sampler, extras, RNG
states, cursor. `capture_rest` runs on the copier thread and walks what only
`optimizer.step()` changes — parameters and optimizer state — which the step pre-hook
keeps unchanged until it is copied. So the loop pays for the small state only, not for
a walk over every parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from m27.train import _rng, _state
from m27.train._gang import is_dtensor, local_of
from m27.train._snapshot import HostBuffers, Snapshot, TensorRef, bytes_of, signature


@dataclass
class Sources:
    """Everything a checkpoint holds, as the program gave it to the Checkpointer."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any = None
    scaler: Any = None
    sampler: Any = None
    extras: dict[str, Any] | None = None


class StateLayout:
    """Which model state_dict keys are parameters, and where each persistent buffer
    lives (so after_step reads buffers without calling model.state_dict())."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {f"model/{name}" for name, _ in
                       model.named_parameters(remove_duplicate=False)}
        self.buffers: list[tuple[str, torch.nn.Module, str]] = []
        for prefix, module in model.named_modules(remove_duplicate=False):
            for attr in module._buffers:
                if attr not in module._non_persistent_buffers_set:
                    key = f"{prefix}.{attr}" if prefix else attr
                    self.buffers.append((f"model/{key}", module, attr))
        # CUDA devices holding parameters: the copies there wait for an event recorded
        # on the compute stream in after_step (learned again from every snapshot).
        self.devices = {p.device.index or 0 for p in model.parameters() if p.is_cuda}


class Capture:
    """Fills a Snapshot's skeleton and tensor list.

    For a rank of a gang (`_ranks`): `names` gives the entry name of a state path (its
    rank's prefix), `shared=False` leaves the model, optimizer, scheduler and scaler out
    (a DDP rank other than 0: rank 0 saves them), and `model_now` reads the model's
    state_dict in after_step, not on the copier thread (FSDP: its state_dict() reshards
    the parameters, which must not happen while the next forward runs). The local shard
    of a DTensor is saved, with what rebuilds it in the skeleton's "dtensors".
    `versions_tell=False`: a tensor other than a DTensor may be written by a collective
    (ZeRO broadcasts the parameters each rank updated), which bumps no version counter,
    so it is never taken as unchanged. `written_unseen`: the storage addresses of the
    parameters an optimizer updates without bumping their version counters (a fused
    kernel, writes through `.data`: `Checkpointer` finds out): they and the optimizer's
    state are never taken as unchanged either."""

    def __init__(self, snapshot: Snapshot, buffers: HostBuffers, layout: StateLayout, *,
                 pack_below: int, skip_unchanged: bool,
                 names: Callable[[str], str] | None = None, shared: bool = True,
                 model_now: bool = False, versions_tell: bool = True,
                 written_unseen: frozenset[int] = frozenset()) -> None:
        self.snapshot, self.buffers, self.layout = snapshot, buffers, layout
        self.pack_below, self.skip_unchanged = pack_below, skip_unchanged
        self.names = names
        self.shared, self.model_now, self.versions_tell = shared, model_now, versions_tell
        self.written_unseen = written_unseen
        self._sync_model: dict[str, int] = {}
        self._optimizer_state: Any = None
        self._model: torch.nn.Module | None = None
        self._model_state: Any = None
        self._cuda_devices: set[int] = set()

    # ------------------------------------------------------------------ in after_step

    def capture_now(self, sources: Sources, cursor: Mapping[str, int]) -> None:
        skeleton = self.snapshot.skeleton
        skeleton["format"] = 1
        if self.shared:
            self._capture_shared(sources)
        else:
            skeleton["model"] = skeleton["optimizer"] = None
            skeleton["scheduler"] = skeleton["scaler"] = None
        skeleton["sampler"] = self._stateful(sources.sampler, "sampler")
        skeleton["extras"] = {name: self._extra(name, value)
                              for name, value in (sources.extras or {}).items()}
        skeleton["rng"] = _state.encode(_rng.capture(), self.sync, "rng")
        skeleton["cursor"] = dict(cursor)
        # One event per device on the compute stream: the small copies above are done when
        # it completes, and the background copies of that device start after it (after
        # the optimizer step just taken).
        for device in sorted(self._cuda_devices | self.layout.devices):
            event = torch.cuda.current_stream(device).record_event()
            self.snapshot.sync_events.append(event)
            self.snapshot.cuda_start[device] = event
        self._cuda_devices.clear()

    def _capture_shared(self, sources: Sources) -> None:
        skeleton = self.snapshot.skeleton
        self._model = sources.model
        for path, module, attr in self.layout.buffers:
            tensor = module._buffers.get(attr)
            if tensor is not None:
                self._sync_model[path] = self.sync(tensor, path)
        if self.model_now:
            self._model_state = sources.model.state_dict()
        state = sources.optimizer.state_dict()
        self._optimizer_state = state["state"]  # live tensors: walked by capture_rest
        skeleton["optimizer"] = {key: _state.encode(value, self.sync, f"optimizer/{key}")
                                 for key, value in state.items() if key != "state"}
        skeleton["scheduler"] = self._stateful(sources.scheduler, "scheduler")
        skeleton["scaler"] = self._scaler(sources.scaler)

    def _stateful(self, obj: Any, path: str) -> Any:
        return None if obj is None else _state.encode(obj.state_dict(), self.sync, path)

    def _extra(self, name: str, value: Any) -> dict[str, Any]:
        path = f"extras/{name}"
        if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
            return {"stateful": _state.encode(value.state_dict(), self.sync, path)}
        return {"value": _state.encode(value, self.sync, path)}

    def _scaler(self, scaler: Any) -> Any:
        """GradScaler.state_dict() calls .item() on its scale, which waits for the GPU;
        its scale and growth tracker are copied as tensors instead."""
        if scaler is None:
            return None
        scale = getattr(scaler, "_scale", None)
        if not getattr(scaler, "_enabled", False) or not isinstance(scale, torch.Tensor):
            return _state.encode(scaler.state_dict(), self.sync, "scaler")
        state = {"scale": scale, "growth_factor": scaler._growth_factor,
                 "backoff_factor": scaler._backoff_factor,
                 "growth_interval": scaler._growth_interval,
                 "_growth_tracker": scaler._growth_tracker}
        max_scale = getattr(scaler, "max_scale", None)
        if max_scale is not None:
            state["max_scale"] = max_scale
        return {"tensors_as_numbers": True, "state": _state.encode(state, self.sync, "scaler")}

    def sync(self, tensor: torch.Tensor, path: str) -> int:
        """A tensor that may change before the next optimizer step: copied now (on a GPU:
        on the compute stream, so the copy is ordered before whatever changes it)."""
        ref, tensor = self._ref(tensor, path)
        if tensor.is_cuda:
            ref.data = torch.empty(ref.nbytes, dtype=torch.uint8, pin_memory=True)
            ref.data.copy_(bytes_of(tensor), non_blocking=True)
            self._cuda_devices.add(tensor.device.index or 0)
        else:
            ref.data = tensor.detach().clone(memory_format=torch.contiguous_format) \
                .reshape(-1).view(torch.uint8)
        return ref.index

    # ------------------------------------------------------------------ on the copier

    def capture_rest(self) -> None:
        """Parameters and optimizer state: planned for the copy (call before it)."""
        skeleton = self.snapshot.skeleton
        if self._model is None:  # not saved by this rank
            return
        model_state = self._model_state if self.model_now else self._model.state_dict()
        skeleton["model"] = _state.encode(model_state, self._model_tensor, "model")
        skeleton["optimizer"]["state"] = _state.encode(
            self._optimizer_state, self._optimizer_tensor, "optimizer/state")
        self._optimizer_state = self._model = self._model_state = None
        self.layout.devices |= self._cuda_devices

    def _model_tensor(self, tensor: torch.Tensor, path: str) -> int:
        if path in self.layout.params:
            return self.background(tensor, path)
        index = self._sync_model.get(path)
        if index is None:
            raise RuntimeError(f"{path} is in model.state_dict() but is neither a parameter "
                               "nor a persistent buffer: not checkpointed consistently")
        return index

    def _optimizer_tensor(self, tensor: torch.Tensor, path: str) -> int:
        return self.background(tensor, path, unseen=bool(self.written_unseen))

    def background(self, tensor: torch.Tensor, path: str, *, unseen: bool = False) -> int:
        """A tensor only optimizer.step() changes: copied by the copier thread (`unseen`:
        its version counter does not tell whether it changed)."""
        ref, local = self._ref(tensor, path)
        ref.source, ref.signature = local.detach(), signature(local)
        if local is not tensor:  # a DTensor: in-place changes bump its version, not its shard's
            address, _, dtype, shape, device = ref.signature
            ref.signature = (address, tensor._version, dtype, shape, device)
        unseen = unseen or local.data_ptr() in self.written_unseen
        self.buffers.plan(ref, skip_unchanged=self.skip_unchanged and not unseen and (
            self.versions_tell or local is not tensor))
        if ref.reuse:
            ref.source = None
        elif local.is_cuda:
            self._cuda_devices.add(local.device.index or 0)
        return ref.index

    def _ref(self, tensor: torch.Tensor, path: str) -> tuple[TensorRef, torch.Tensor]:
        """A new ref for `tensor` and the tensor whose bytes it holds (a DTensor's shard)."""
        index = len(self.snapshot.refs)
        if is_dtensor(tensor):
            tensor, described = local_of(tensor, path)
            self.snapshot.skeleton.setdefault("dtensors", {})[str(index)] = described
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_meta:
            raise TypeError(f"cannot checkpoint {path}: a {tensor.layout} tensor")
        nbytes = tensor.numel() * tensor.element_size()
        ref = TensorRef(index=index, name=self.names(path) if self.names else path,
                        dtype=tensor.dtype, shape=tuple(tensor.shape), nbytes=nbytes,
                        packed=nbytes < self.pack_below)
        self.snapshot.refs.append(ref)
        return ref, tensor

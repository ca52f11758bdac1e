"""transformers' weight initialisation of a meta-device model, with one module's tensors alive at a time.

``init_weights`` (models.py) runs transformers' own ``PreTrainedModel.init_weights`` over a model whose tensors all
exist. ``init_by_module`` runs the very same call over a meta skeleton, intercepting transformers' per-module step
(``_initialize_weights``, which its ``smart_apply`` calls children first: compat/module_init.py), and gives each tensor real storage only
from the first module initialisation that writes it to the last one: its draws are the whole-model init's draws (the
same functions, on the same shapes, in the same order, from the same generator), so the tensors it hands out are the
ordinary build's weights bit for bit, while no more than one module's tensors are alive (plus those an ancestor's
init writes again: GPT-2's scaled ``c_proj`` weights, drawn by their Conv1D, then by the attention or MLP above it).

Which initialisation writes which tensor is learnt first by a dry run over the meta skeleton (writes to meta tensors
draw nothing and cost nothing), so the walk holds no guess about any family's ``_init_weights``; a write that the
dry run did not foresee (a tensor not alive when written) is refused, never silently dropped.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import transformers
from torch import nn
from torch.overrides import TorchFunctionMode

from ..compat.module_init import each_module_init

Emit = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], None]


@contextlib.contextmanager
def initialising(model: transformers.PreTrainedModel) -> Iterator[None]:
    """The state in which transformers' ``init_weights`` initialises every module of a model materialised from (or
    still on) the meta device, and only once each tensor that is tied."""
    for module in model.modules():  # from_config marked every module initialised while it was on meta
        module._is_hf_initialized = False
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is not None and inp is not None and out.weight is inp.weight:
        # A tied head gets its values from the input embedding's init, as in transformers' own build; under
        # FSDP2 transformers no longer sees the tie and would draw the head again over the embedding.
        out._is_hf_initialized = True
    # fully_shard swaps in a class of its own (FSDP<name>, defined outside transformers), which transformers
    # takes for custom code and then skips modules without direct parameters (GPT-2's scaled c_proj init):
    # answer as the model's own class does.
    own = next(c for c in type(model).__mro__ if issubclass(c, transformers.PreTrainedModel) and c.__module__.startswith("transformers."))
    model.is_custom_code = own.is_custom_code
    try:
        with torch.no_grad():
            yield
    finally:
        del model.is_custom_code


def _written(func, args, kwargs) -> torch.Tensor | None:
    """The tensor an in-place torch call writes (``normal_``, ``copy_``, ``t[i] = v``: the first argument; torch.nn.init
    passes it by keyword, as ``tensor``), else None."""
    name = getattr(func, "__name__", "")
    if name != "__setitem__" and (not name.endswith("_") or name.startswith("__")):
        return None
    target = args[0] if args else (kwargs or {}).get("tensor")
    return target if isinstance(target, torch.Tensor) else None


class _OnWrite(TorchFunctionMode):
    """Calls ``on_write(tensor)`` before every in-place torch call on ``tensor`` (the outermost call: torch runs a
    mode's handler with the mode off, so ``nn.init.normal_`` is seen once, not again as its ``Tensor.normal_``)."""

    def __init__(self, on_write: Callable[[torch.Tensor], None]):
        super().__init__()
        self.on_write = on_write

    def __torch_function__(self, func, types, args=(), kwargs=None):
        target = _written(func, args, kwargs)
        if target is not None:
            self.on_write(target)
        return func(*args, **(kwargs or {}))


@dataclass
class _Slot:
    """One tensor of the skeleton: its state-dict name, the meta original, every (module, attribute) that holds it (a
    tied head holds its embedding's), and the first and last initialisation (visit index) that write it."""

    name: str
    original: torch.Tensor
    holders: list[tuple[nn.Module, str]]
    is_param: bool
    first: int | None = None
    last: int | None = None
    value: torch.Tensor | None = None  # its real tensor while the walk holds it

    def hold(self, value: torch.Tensor) -> None:
        for module, attr in self.holders:
            (module._parameters if self.is_param else module._buffers)[attr] = value


def _storage(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage, shared by its views, its ``.data`` and a tied tensor. A meta storage has no
    data pointer (0 for all), so it is the storage object's own address."""
    return t.untyped_storage()._cdata


def _slots(model: nn.Module) -> dict[int, _Slot]:
    """Every parameter and buffer of ``model``, keyed by its storage."""
    names = {**{_storage(t): (n, True) for n, t in model.named_parameters()},
             **{_storage(t): (n, False) for n, t in model.named_buffers()}}
    slots: dict[int, _Slot] = {}
    for module in model.modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for attr, t in table.items():
                if t is None:
                    continue
                key = _storage(t)
                slot = slots.get(key)
                if slot is None:
                    slot = slots[key] = _Slot(names[key][0], t, [], is_param)
                slot.holders.append((module, attr))
    return slots


def _run_init(model: transformers.PreTrainedModel, before: Callable[[int, nn.Module], None],
              after: Callable[[int], None], on_write: Callable[[torch.Tensor], None]) -> int:
    """transformers' ``init_weights`` over ``model``, each module's initialisation (visit ``i``) between
    ``before(i, module)`` and ``after(i)``, its writes reported to ``on_write``; returns the number of visits."""
    owners = [m for m in model.modules() if isinstance(m, transformers.PreTrainedModel)]
    visits = 0

    def wrap(initialise):
        def visit(module, is_custom_code=False):
            nonlocal visits
            index, visits = visits, visits + 1
            before(index, module)
            with _OnWrite(on_write):
                initialise(module, is_custom_code)
            after(index)
        return visit

    with each_module_init(owners, wrap), initialising(model):  # compat/module_init.py
        model.init_weights()
    return visits


def init_by_module(model: transformers.PreTrainedModel, device: torch.device, emit: Emit) -> None:
    """transformers' initialisation of ``model``, a skeleton on the meta device (not sharded, not wrapped), drawn on
    ``device`` from its default generator (seed it as the ordinary build does), handed out as it completes: each
    ``emit(params, buffers)`` receives full tensors under the model's state-dict names (a tied tensor once, under its
    first name), none of which any later initialisation writes. At most ``peak_bytes`` of them are alive at once. A
    tensor no initialisation writes is never emitted (the ordinary build leaves it as torch.empty made it). The
    skeleton ends as it began, on meta."""
    slots, order = _dry_run(model)
    starts: dict[int, list[_Slot]] = {}
    ends: dict[int, list[_Slot]] = {}
    for slot in slots.values():
        if slot.first is not None:
            starts.setdefault(slot.first, []).append(slot)
            ends.setdefault(slot.last, []).append(slot)

    def before(index: int, module: nn.Module) -> None:
        if index >= len(order) or order[index] is not module:
            raise RuntimeError(f"transformers initialised {type(module).__name__} out of the order of its dry run")
        for slot in starts.get(index, ()):
            value = torch.empty_like(slot.original, device=device)
            slot.value = nn.Parameter(value, requires_grad=slot.original.requires_grad) if slot.is_param else value
            slot.hold(slot.value)

    def after(index: int) -> None:
        done = ends.get(index, ())
        if not done:
            return
        emit({s.name: s.value.detach() for s in done if s.is_param}, {s.name: s.value for s in done if not s.is_param})
        for slot in done:
            slot.hold(slot.original)
            slot.value = None

    def refuse_meta(t: torch.Tensor) -> None:
        if t.is_meta:
            slot = slots.get(_storage(t))
            raise RuntimeError(f"an initialisation wrote {slot.name if slot else 'a meta tensor'} outside the span its "
                               "dry run found: init_by_module cannot reproduce this model's init")

    if _run_init(model, before, after, refuse_meta) != len(order):
        raise RuntimeError("transformers initialised other modules than in its dry run")


def _dry_run(model: transformers.PreTrainedModel) -> tuple[dict[int, _Slot], list[nn.Module]]:
    """The skeleton's tensors, each with the first and last visit that writes it, and the modules in visit order:
    transformers' init run over the meta skeleton (writes to meta tensors draw nothing)."""
    slots = _slots(model)
    order: list[nn.Module] = []

    def seen(t: torch.Tensor) -> None:
        slot = slots.get(_storage(t))
        if slot is not None:
            slot.first = len(order) - 1 if slot.first is None else slot.first
            slot.last = len(order) - 1

    _run_init(model, lambda i, m: order.append(m), lambda i: None, seen)
    unwritten = [s.name for s in slots.values() if s.is_param and s.first is None]
    if unwritten:  # the ordinary build would leave them as torch.empty made them, or transformers skipped the hook
        raise RuntimeError(f"transformers' init wrote no value into {unwritten[:3]} through _initialize_weights: "
                           "init_by_module cannot reproduce this model's init")
    return slots, order


def _peak(slots, visits: int) -> int:
    """The most bytes alive at once when every tensor lives from its first write to its last."""
    delta = [0] * (visits + 1)
    for s in slots:
        if s.first is not None:
            delta[s.first] += s.original.numel() * s.original.element_size()
            delta[s.last + 1] -= s.original.numel() * s.original.element_size()
    alive = peak = 0
    for d in delta:
        alive += d
        peak = max(peak, alive)
    return peak


def peak_bytes(model: transformers.PreTrainedModel) -> int:
    """The most bytes of full tensors ``init_by_module`` holds at once for this meta skeleton: for the GPT-2, BLOOM and
    Llama families, the largest module's own parameters (the embedding, or an untied head)."""
    slots, order = _dry_run(model)
    return _peak(slots.values(), len(order))

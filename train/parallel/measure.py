"""Per-rank memory measurement: parameters, gradients, optimizer state, and the activations
autograd saves for backward (``saved_tensors_hooks``, unique storages, parameters excluded)."""
from __future__ import annotations

import contextlib

import torch


def tensor_bytes(tensors) -> int:
    """Bytes of the unique storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


@contextlib.contextmanager
def saved_activations(params=()):
    """``with saved_activations(model.parameters()) as box:`` ... ``box["bytes"]``: bytes of the
    unique storages saved for backward inside the block, parameters' storages excluded."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}
    box = {"bytes": 0}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip and st.nbytes() > 0:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield box
    box["bytes"] = sum(seen.values())


def optimizer_bytes(opt) -> int:
    return tensor_bytes(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)

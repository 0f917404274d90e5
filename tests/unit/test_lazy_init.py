"""A claimed spare's build with deferred random fills (runtime/lazy_init.py): every value any
code can read, and the generator after the build, equal those of the plain build."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from livemig.runtime.lazy_init import LazyInit


class Net(torch.nn.Module):
    """Inits the way user models do: Linear's kaiming_uniform_, normal_ by hand (GPT-2),
    trunc_normal_ (an in-place op after the fill), an explicit generator, and a weight tie."""

    def __init__(self, gen: torch.Generator | None = None) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.fc = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.pos = torch.nn.Parameter(torch.empty(8, 16))
        torch.nn.init.trunc_normal_(self.pos, std=0.02)
        self.extra = torch.nn.Parameter(torch.empty(16))
        torch.nn.init.normal_(self.extra, std=0.02, generator=gen)
        torch.nn.init.normal_(self.fc.weight, std=0.02 / math.sqrt(2))


def build(seed: int = 1234) -> tuple[Net, torch.Tensor]:
    """A script's start: a seed, the model, then a draw from the global generator."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    net = Net(gen)
    data = torch.randn(4, 16)  # drawn after the build: the same values need the same generator state
    return net, data


def warmed() -> LazyInit:
    lz = LazyInit()
    lz.record()
    build()
    lz.loop_starts()
    assert not _get_current_dispatch_mode_stack()
    return lz


def swap_in(net: Net, ref: Net) -> None:
    """What a follower's take-over does: the held tensors become the new objects' data."""
    with torch.no_grad():
        new, held = net.state_dict(keep_vars=True), ref.state_dict(keep_vars=True)
        for k, v in new.items():
            v.data = held[k].data.clone()


def test_fills_of_swapped_tensors_never_run_and_the_generator_ends_where_the_plain_build_leaves_it() -> None:
    ref, ref_data = build()
    after_ref = torch.rand(3)
    lz = warmed()
    lz.defer()
    net, data = build()
    assert torch.equal(data, ref_data)
    assert torch.equal(torch.rand(3), after_ref)
    swap_in(net, ref)
    lz.finish()
    assert not _get_current_dispatch_mode_stack()
    f = lz.figures
    assert f["deferred"] >= 4 and f["ran"] == 1, f  # the trunc_normal_ one ran at its erfinv_; the rest dropped
    assert f["dropped"] == f["deferred"] - f["ran"]
    for (k, a), b in zip(net.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_a_tensor_read_or_kept_apart_gets_the_plain_builds_values() -> None:
    ref, _ = build()
    lz = warmed()
    lz.defer()
    net, _ = build()
    norm = net.fc.weight.norm()  # read before the load: the fill runs first
    kept = net.emb.weight.detach()  # a view kept past the swap: its storage is still held
    as_double = net.extra.to(torch.float64)
    swap_in(net, ref)
    lz.finish()
    assert torch.equal(norm, ref.fc.weight.norm())
    assert torch.equal(kept, ref.emb.weight)
    assert torch.equal(as_double, ref.extra.to(torch.float64))


def test_a_whole_overwrite_drops_the_fill_and_a_load_in_place_keeps_the_loaded_values() -> None:
    ref, _ = build()
    lz = warmed()
    lz.defer()
    net, _ = build()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.ones_like(p))  # a streamed take-over loads into the built tensors
    lz.finish()
    assert all(bool((p == 1).all()) for p in net.parameters())
    assert lz.figures["ran"] <= 1  # trunc_normal_'s ran at its erfinv_, before the copy


def test_another_seed_is_not_in_the_memo_and_builds_as_usual() -> None:
    ref, ref_data = build(seed=7)
    lz = warmed()
    lz.defer()
    net, data = build(seed=7)
    lz.finish()
    assert lz.figures["deferred"] == 0
    assert torch.equal(data, ref_data)
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_mode_the_function_pushed_above_stays_and_ours_leaves() -> None:
    class Counting(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops += 1
            return func(*args, **(kwargs or {}))

    lz = warmed()
    lz.defer()
    build()
    user = Counting()
    user.__enter__()
    try:
        lz.finish()
        assert _get_current_dispatch_mode_stack() == [user]
        torch.ones(2).sum()
        assert user.ops >= 2
    finally:
        user.__exit__(None, None, None)
    assert not _get_current_dispatch_mode_stack()


@pytest.mark.parametrize("role,claimed", [("worker", False), ("spare", True)])
def test_only_a_spare_records_and_only_a_claim_defers(role: str, claimed: bool) -> None:
    class Claim:
        migration = restart = redo = False

    lz = LazyInit()
    lz.enter(role, None)
    build()
    lz.loop_starts()
    assert bool(lz.memo) == (role == "spare")
    lz.enter(role, Claim() if claimed else None)
    assert bool(_get_current_dispatch_mode_stack()) == (role == "spare")
    lz.finish()
    assert not _get_current_dispatch_mode_stack()


def test_a_copy_from_a_view_of_the_same_pending_tensor_reads_the_fill_first() -> None:
    lz = LazyInit()
    lz.record()
    torch.manual_seed(3)
    torch.empty(4, 4).uniform_()
    lz.loop_starts()
    torch.manual_seed(3)
    ref = torch.empty(4, 4).uniform_()
    lz.defer()
    torch.manual_seed(3)
    w = torch.empty(4, 4).uniform_()
    w.copy_(w.view(16).view(4, 4))  # reads its own storage through a view: the fill runs before the copy
    lz.finish()
    assert torch.equal(w, ref)


def test_a_streamed_take_over_names_what_it_writes_whole_and_those_fills_never_run() -> None:
    ref, _ = build()
    lz = warmed()
    lz.defer()
    net, _ = build()
    lz.finish(overwritten=list(net.state_dict().values()))
    assert lz.figures["ran"] == 1  # only trunc_normal_'s, at its erfinv_, inside the build
    net.load_state_dict(ref.state_dict())
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


def test_reads_past_the_dispatcher_get_the_plain_builds_values(tmp_path) -> None:
    """numpy(), tolist() and torch.save (rank 0 saving its initial model before the loop) read
    the storage directly: the fills run first."""
    ref, _ = build()
    lz = warmed()
    lz.defer()
    net, _ = build()
    as_numpy = net.fc.weight.detach().numpy().copy()
    as_list = net.fc.bias.tolist()
    torch.save(net.state_dict(), tmp_path / "init.pt")
    swap_in(net, ref)
    lz.finish()
    assert torch.equal(torch.from_numpy(as_numpy), ref.fc.weight.detach())
    assert as_list == ref.fc.bias.tolist()
    saved = torch.load(tmp_path / "init.pt", weights_only=True)
    for k, v in ref.state_dict().items():
        assert torch.equal(saved[k], v), k


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_model_moved_after_its_build_waits_through_the_copy(dtype: torch.dtype) -> None:
    """`Net().to(device)` (a CPU stand-in: `.to(dtype)`, the same aten._to_copy): the copy's
    values are the fills' copied; swapped away, neither the fills nor the copy run."""
    ref = build()[0].to(dtype)
    lz = LazyInit()
    lz.record()
    build()[0].to(dtype)
    lz.loop_starts()
    lz.defer()
    net = build()[0].to(dtype)
    moved = net.extra.detach()  # kept: its copy runs at the end
    norm = net.fc.weight.float().norm()  # read now: its copy runs now
    swap_in(net, ref)
    lz.finish()
    assert torch.equal(moved, ref.extra.detach()) and torch.equal(norm, ref.fc.weight.float().norm())
    assert lz.figures["ran"] <= 3, lz.figures  # the two read, and trunc_normal_'s at its erfinv_
    lz.defer()
    net = build()[0].to(dtype)
    lz.finish()
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)

"""ZeRO-1 mechanics on a real 2-rank gloo group (two threads of this process):
the sharded update must equal plain data-parallel AdamW bit for bit, and a
mirror must equal the shard it mirrors."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from livemig.comm.reducer import GradReducer
from livemig.comm.zero1 import Zero1, shard_pieces
from livemig.coordinator.sharding import lost_shards, sharding_of, zero1_layout
from livemig.errors import ConfigError, RecoveryError

T = timedelta(seconds=20)


def model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5))


def optimizer(m: torch.nn.Module, **kw) -> torch.optim.Optimizer:
    decay = [p for n, p in m.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in m.named_parameters() if not n.endswith("weight")]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-2, **kw)


def grads(m: torch.nn.Module, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(4, 13, generator=g), torch.randn(4, 5, generator=g)
    torch.nn.functional.mse_loss(m(x), y).backward()


def run_rank(rank: int, world: int, store: dist.Store, steps: int, m: torch.nn.Module, out: dict,
             scatter: bool) -> None:  # fmt: skip
    opt = optimizer(m)
    params = list(m.parameters())
    red = GradReducer(params, shard_world=world, scatter=scatter, world=world)
    z = Zero1(red, params, opt, rank, world)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("z", store), rank, world, T)
    for step in range(steps):
        red.arm(pg)
        grads(m, rank, step)
        reduced = red.finish(world, T, lambda: False)
        own, mirror = z.slices(pg, reduced, T, lambda: False)
        z.barrier(pg, T, lambda: False)
        z.update(own, mirror)
        for p in params:
            p.grad = None
        z.gather(pg, T, lambda: False)
    out[rank] = (m, z)


@pytest.mark.parametrize("scatter", [True, False], ids=["reduce_scatter", "allreduce"])
def test_sharded_update_equals_plain_adamw_and_mirror_is_exact(scatter):
    """The shards use AdamW's multi-tensor path (the template leaves foreach unset):
    the reference is plain data-parallel AdamW with foreach=True."""
    world, steps = 2, 5
    store = dist.HashStore()
    out: dict = {}
    models = [model() for _ in range(world)]  # built here: torch.manual_seed is process-global
    threads = [threading.Thread(target=run_rank, args=(r, world, store, steps, models[r], out, scatter))
               for r in range(world)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(out) == {0, 1}
    ref = model()
    opt = optimizer(ref, foreach=True)
    for step in range(steps):  # plain data parallel: the sum of the ranks' gradients divided first, as DDP
        acc = [torch.zeros_like(p) for p in ref.parameters()]
        for r in range(world):
            ref.zero_grad()
            grads(ref, r, step)
            for a, p in zip(acc, ref.parameters(), strict=True):
                a.add_(p.grad / world)
        for a, p in zip(acc, ref.parameters(), strict=True):
            p.grad = a
        opt.step()
    for r in range(world):
        for p, q in zip(out[r][0].parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q), f"rank {r}: sharded parameters differ from plain AdamW"
    for r in range(world):
        own, mirror_at_next = out[r][1].own, out[(r + 1) % world][1].mirror
        assert mirror_at_next.shard == r
        for a, b in zip(own.values, mirror_at_next.values, strict=True):
            assert torch.equal(a, b)
        sa, sb = own.opt.state_dict()["state"], mirror_at_next.opt.state_dict()["state"]
        assert sa.keys() == sb.keys() and sa
        for k in sa:
            for name in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(sa[k][name], sb[k][name]), f"mirror of shard {r} drifted in {name}"


def run_shrunk(rank: int, store: dist.Store, steps: int, m: torch.nn.Module, out: dict) -> None:
    """Physical rank `rank` of 2 in a 3-rank job whose rank 2 is carried by 0: the carrier owns
    shard 2 (it mirrored it) and takes shard 1's mirror, rank 1 takes shard 2's (zero1_layout)."""
    from livemig.comm.group import allreduce_sum
    from livemig.comm.zero1 import ShardState

    world, carried = 3, {2: 0}
    opt, params = optimizer(m), list(m.parameters())
    red = GradReducer(params, shard_world=world, scatter=False, world=world)
    z = Zero1(red, params, opt, rank, world)
    assert sorted(z.shards) == sorted([rank, (rank - 1) % world])
    need = z.stage(carried)
    for s in need:  # at step 0 every holder's copy is the initial one: cut it here
        z.adopt(s, ShardState(red, z.group_of, opt, s).state())
    z.switch(carried)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("s", store), rank, 2, T)
    for step in range(steps):
        for v in [v for v in (0, 1, 2) if carried.get(v, v) == rank]:  # this process's bodies
            grads(m, v, step)
        flats = red.flatten(world)
        allreduce_sum(pg, flats, T, lambda: False)
        held = z.slices_shrunk(flats)
        z.barrier(pg, T, lambda: False)
        z.update(held, part="owned")
        z.gather(pg, T, lambda: False, meanwhile=lambda held=held: z.update(held, part="mirrored"))
        for p in params:
            p.grad = None
    out[rank] = (m, z, need)


def test_a_shrunk_layout_steps_every_shard_once_and_mirrors_it_on_the_other_process():
    """2 processes run the 3 ranks of the full-width run (test above): the parameters equal it
    within rounding (the carrier sums two gradients before the all-reduce), and every shard has
    an exact mirror on the process that does not own it."""
    store, out, steps = dist.HashStore(), {}, 5
    models = [model() for _ in range(2)]
    threads = [threading.Thread(target=run_shrunk, args=(r, store, steps, models[r], out)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(out) == {0, 1}
    assert out[0][2] == [1] and out[1][2] == [2]  # the mirrors the new layout moved
    assert out[0][1].owned() == [0, 2] and out[1][1].mirrored() == [0, 2]
    ref = model()
    opt = optimizer(ref, foreach=True)
    for step in range(steps):
        acc = [torch.zeros_like(p) for p in ref.parameters()]
        for r in range(3):
            ref.zero_grad()
            grads(ref, r, step)
            for a, p in zip(acc, ref.parameters(), strict=True):
                a.add_(p.grad / 3)
        for a, p in zip(acc, ref.parameters(), strict=True):
            p.grad = a
        opt.step()
    for r in range(2):
        for p, q in zip(out[r][0].parameters(), ref.parameters(), strict=True):
            assert torch.allclose(p, q, rtol=0, atol=1e-6), f"process {r}: shrunk parameters off the full run's"
        assert all(torch.equal(a, b) for a, b in zip(out[0][0].parameters(), out[r][0].parameters(), strict=True))
    for s in range(3):
        owner, mirror = (0, 1) if s != 1 else (1, 0)
        a, b = out[owner][1].shards[s], out[mirror][1].shards[s]
        assert all(torch.equal(x, y) for x, y in zip(a.values, b.values, strict=True)), f"shard {s}'s mirror"
    out[0][1].switch({})  # back to full width: rank 0 keeps its shard and the mirror of 2, drops 1
    assert sorted(out[0][1].shards) == [0, 2]
    with pytest.raises(RecoveryError, match=r"holds no copy of optimizer shard\(s\) \[1\]"):
        out[0][1].switch({2: 0})  # shard 1's mirror was dropped and nothing was staged for it


def test_pieces_cover_every_element_once_and_split_at_param_groups():
    m = model()
    opt = optimizer(m)
    params = list(m.parameters())
    pid = {id(p): g for g, grp in enumerate(opt.param_groups) for p in grp["params"]}
    for world in (1, 2, 3, 5):
        red = GradReducer(params, shard_world=world)
        group_of = [pid[id(p)] for p in red.params]
        covered = 0
        for shard in range(world):
            for pc in shard_pieces(red, group_of, shard):
                assert 0 <= pc.start and pc.start + pc.length <= red.shard_sizes[pc.bucket]
                covered += pc.length
        assert covered == sum(p.numel() for p in params)
    # two groups alternate (weight, bias, weight, bias): a world of 1 has 4 pieces
    red = GradReducer(params, shard_world=1)
    assert len(shard_pieces(red, [pid[id(p)] for p in red.params], 0)) == 4


def test_refuses_optimizers_that_are_not_elementwise_and_user_steps():
    m = model()
    params = list(m.parameters())
    with pytest.raises(ConfigError, match="element-wise"):
        Zero1(GradReducer(params, 2), params, torch.optim.LBFGS(params), 0, 2)
    opt = optimizer(m)
    Zero1(GradReducer(params, 2), params, opt, 0, 2)
    with pytest.raises(ConfigError, match="stepped by ctx.step"):
        opt.step()


def test_zero1_layout_full_and_shrunk():
    assert zero1_layout(4) == {0: (0, 1), 1: (1, 2), 2: (2, 3), 3: (3, 0)}
    assert zero1_layout(4, stride=2) == {0: (0, 2), 1: (1, 3), 2: (2, 0), 3: (3, 1)}
    # rank 2 lost, carried by its mirror's holder 3: 3 owns shards 2 and 3; shard 2's next
    # virtual rank (3) is on the same process, so its mirror moves on to rank 0
    assert zero1_layout(4, {2: 3}) == {0: (0, 1), 1: (1, 3), 2: (3, 0), 3: (3, 0)}
    assert zero1_layout(3, {2: 0}) == {0: (0, 1), 1: (1, 0), 2: (0, 1)}
    assert zero1_layout(2, {1: 0}) == {0: (0, None), 1: (0, None)}  # one process: no second copy
    assert zero1_layout(3, mirrored=False) == {0: (0, None), 1: (1, None), 2: (2, None)}
    for world, carried in ((4, {2: 3}), (6, {1: 2, 4: 5}), (6, {0: 3, 1: 3}), (8, {3: 5})):
        for s, (owner, mirror) in zero1_layout(world, carried, stride=2 if world % 2 == 0 else 1).items():
            assert owner == carried.get(s, s) and mirror not in (owner, None) and mirror not in carried


def test_lost_shards_names_owner_and_mirror():
    assert lost_shards(3, True, {0, 2}) == []  # shard 1 lives on at its mirror, rank 2
    lost = "optimizer shard 1 is lost: its owner rank 1 and its mirror rank 2 both failed"
    assert lost_shards(3, True, {0}) == [lost]
    assert lost_shards(2, False, {0})[0].startswith("optimizer shard 1 is lost: its owner rank 1 failed")
    # shrunk (rank 2 carried by 0): shard 2 is owned by 0 and mirrored on 1, so losing 0 too loses
    # shards 0 and 2 only if 1 is gone as well
    assert lost_shards(3, True, {1}, carried={2: 0}) == []
    assert lost_shards(2, True, {0}, carried={1: 0}) == []
    assert lost_shards(2, True, set(), carried={1: 0})[1] == (
        "optimizer shard 1 is lost: its owner rank 0 failed and no other process was left to mirror it"
    )
    assert sharding_of([["w", "float32", [2]], ["<sharding>", "zero1", [1]]]) == ("zero1", True)
    assert sharding_of([["w", "float32", [2]]]) == ("", False)


def _zero1_at(world: int, rank: int):
    """A two-group AdamW (one lr each) sharded over `world`; the same model at any world size."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Linear(13, 5), torch.nn.Linear(5, 3))
    ps = list(m.parameters())
    opt = torch.optim.AdamW([{"params": ps[:3]}, {"params": ps[3:], "lr": 0.01}], lr=0.1)
    red = GradReducer(ps, shard_world=world)
    return Zero1(red, ps, opt, rank, world, mirror=world > 1)


def _step_all(zs: list, grads: list[torch.Tensor], mirror: bool = False) -> None:
    for z in zs:
        st = z.mirror if mirror else z.own
        s = z.red.shard_sizes
        padded = [torch.cat([g, g.new_zeros(n - g.numel())]) for g, n in zip(grads, z.red.padded, strict=True)]
        st.update([padded[b][st.shard * s[b] : (st.shard + 1) * s[b]] for b in range(len(s))])


def _whole(zs: list) -> list[torch.Tensor]:
    return [torch.cat([z.own.values[b] for z in zs])[:n] for b, n in enumerate(zs[0].red.sizes)]


@pytest.mark.parametrize("new_world", [1, 2, 4, 5])
def test_shards_resharded_to_another_world_size_step_as_the_old_ones(new_world):
    """A checkpoint's shards of 3 ranks, re-split over another world size (the own shard and
    the mirror), then stepped once more with the same gradients: the same values as the 3
    shards stepped on, element for element (AdamW is element-wise)."""
    g = torch.Generator().manual_seed(1)
    old = [_zero1_at(3, r) for r in range(3)]
    grads = [[torch.randn(n, generator=g) for n in old[0].red.sizes] for _ in range(2)]
    _step_all(old, grads[0])
    parts = [z.own.state() for z in old]
    new = [_zero1_at(new_world, r) for r in range(new_world)]
    for z in new:
        z.own.load_resharded(parts)
        if z.mirror is not None:
            z.mirror.load_resharded(parts)
    assert all(torch.equal(x, y) for x, y in zip(_whole(old), _whole(new), strict=True))
    _step_all(old, grads[1])
    _step_all(new, grads[1])
    if new_world > 1:
        _step_all(new, grads[1], mirror=True)
        for z in new:  # the mirror of shard r - stride equals that shard
            src = next(o for o in new if o.own.shard == z.mirror.shard)
            assert all(torch.equal(a, b) for a, b in zip(src.own.values, z.mirror.values, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(_whole(old), _whole(new), strict=True))


@pytest.mark.parametrize("rows", [32, 11, 1, 3])
@pytest.mark.parametrize(("old", "new"), [(4, 2), (2, 3), (4, 3), (3, 4), (2, 1)])
def test_fsdp2_shards_recut_for_another_mesh_are_fully_shards_own_cut(rows, old, new):
    """A checkpoint's FSDP2 shards of `old` shards re-cut for `new` (runtime/strategies/
    fsdp2_shards.py recut): each piece equals fully_shard's dim-0 chunk of the whole tensor,
    empty trailing shards included; Adam's moments follow their parameter, its step count stays."""
    from livemig.runtime.strategies.fsdp2_shards import piece, recut

    g = torch.Generator().manual_seed(rows * 10 + old)
    w, b = torch.randn(rows, 5, generator=g), torch.randn(rows, generator=g)
    m, v = torch.randn(rows, 5, generator=g), torch.rand(rows, 5, generator=g)
    groups = [{"lr": 0.1, "params": [0, 1]}]

    def part(k: int, n: int) -> dict:
        st = {"step": torch.tensor(7.0), "exp_avg": piece(m, n, k), "exp_avg_sq": piece(v, n, k)}
        state = {"0": st, "1": {"step": torch.tensor(7.0)}}
        return {"params": [piece(w, n, k), piece(b, n, k)], "optimizer": {"state": state, "param_groups": groups}}

    parts = [part(k, old) for k in range(old)]
    for k in range(new):
        got, want = recut(parts, new, k), part(k, new)
        for x, y in zip(got["params"], want["params"], strict=True):
            assert x.shape == y.shape and torch.equal(x, y), (k, x.shape, y.shape)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got["optimizer"]["state"][0][key], want["optimizer"]["state"]["0"][key]), (k, key)
        assert torch.equal(got["optimizer"]["state"][1]["step"], torch.tensor(7.0))
        assert got["optimizer"]["param_groups"] == groups
    whole = torch.cat([recut(parts, new, k)["params"][0] for k in range(new)])
    assert torch.equal(whole, w)

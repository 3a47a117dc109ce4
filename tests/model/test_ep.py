"""Expert parallelism: placements, and the dispatch/combine over real gloo processes against
the single-process ``run_experts``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from swaserve.model.ep import EPShard, ExpertPlacement, PlacementError, TorchComm
from swaserve.model.layers import run_experts

H, INTER, E, K = 16, 8, 8, 2


def test_contiguous_placement() -> None:
    p = ExpertPlacement.contiguous(8, 4)
    assert p.ranks == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert p.owner().tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert p.local_index().tolist() == [0, 1] * 4
    with pytest.raises(PlacementError, match="must divide"):
        ExpertPlacement.contiguous(8, 3)


def test_placement_file(tmp_path: Path) -> None:
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"ranks": [[7, 0, 3], [1, 2, 4, 5, 6]]}))
    p = ExpertPlacement.from_file(f, 8, 2)
    assert p.owner().tolist() == [0, 1, 1, 0, 1, 1, 1, 0]
    assert p.local_index().tolist() == [1, 0, 1, 2, 2, 3, 4, 0]
    with pytest.raises(PlacementError, match="has 2 ranks, EP size is 3"):
        ExpertPlacement.from_file(f, 8, 3)
    with pytest.raises(PlacementError, match="the model has 9"):
        ExpertPlacement.from_file(f, 9, 2)
    f.write_text(json.dumps({"ranks": [[0, 1, 1], [2, 3]]}))
    with pytest.raises(PlacementError, match="repeated: \\[1\\]"):
        ExpertPlacement.from_file(f, 4, 2)
    f.write_text("{")
    with pytest.raises(PlacementError, match=r"p\.json"):
        ExpertPlacement.from_file(f, 4, 2)


class _Solo:
    rank, size = 0, 1

    def all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        assert send_splits == recv_splits
        return send.clone()

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x[None]


def _weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(E, INTER, H, generator=g) * 0.3,
        torch.randn(E, INTER, H, generator=g) * 0.3,
        torch.randn(E, H, INTER, generator=g) * 0.3,
    )


def _tokens(n: int, seed: int, experts: list[int] | None = None) -> tuple[torch.Tensor, ...]:
    """n tokens [n, H], router weights [n, K], distinct expert ids [n, K] (from ``experts``)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=g)
    pool = torch.tensor(experts if experts is not None else list(range(E)))
    ids = (
        torch.stack([pool[torch.randperm(len(pool), generator=g)[:K]] for _ in range(n)])
        if n
        else torch.empty(0, K, dtype=torch.int64)
    )
    w = torch.rand(n, K, generator=g)
    return x, w, ids


def test_one_rank_is_run_experts_bit_for_bit() -> None:
    wg, wu, wd = _weights()
    x, w, ids = _tokens(37, 1)
    shard = EPShard(ExpertPlacement.contiguous(E, 1), _Solo(), 1)
    out = shard.run(0, x, w, ids, wg, wu, wd)
    assert torch.equal(out, run_experts(x, w, ids, wg, wu, wd))
    assert shard.stats.rows == [37 * K]


# per rank: (tokens, seed, experts its tokens route to); rank 2 has no tokens, and nobody routes to
# experts 6 and 7 (rank 3's): a rank that sends nothing and a rank that receives nothing
CASES = {
    2: [(13, 10, None), (0, 11, None)],
    4: [(9, 20, [0, 1, 2, 3]), (17, 21, [0, 2, 4, 5]), (0, 22, None), (5, 23, [1, 4])],
}


def _rank(rank: int, size: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    try:
        placement = ExpertPlacement.contiguous(E, size)
        shard = EPShard(placement, TorchComm(), 2)
        wg, wu, wd = _weights()
        mine = list(placement.ranks[rank])
        n, seed, experts = CASES[size][rank]
        x, w, ids = _tokens(n, seed, experts)
        outs = [shard.run(layer, x, w, ids, wg[mine], wu[mine], wd[mine]) for layer in (0, 1)]
        shard.end_step()
        torch.save({"out": outs, "stats": shard.stats}, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.cluster
@pytest.mark.parametrize("size", [2, 4])
def test_gloo_ranks_equal_run_experts(size: int, tmp_path: Path) -> None:
    mp.spawn(_rank, args=(size, str(tmp_path / "store"), str(tmp_path)), nprocs=size, join=True)
    wg, wu, wd = _weights()
    for rank in range(size):
        got = torch.load(tmp_path / f"{rank}.pt", weights_only=False)
        n, seed, experts = CASES[size][rank]
        x, w, ids = _tokens(n, seed, experts)
        ref = run_experts(x, w, ids, wg, wu, wd) if n else torch.zeros(0, H)
        for out in got["out"]:
            assert out.shape == (n, H)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    # the balance every rank gathered: rows each rank computed, from the routing alone
    per_rank = [0] * size
    for rank in range(size):
        n, seed, experts = CASES[size][rank]
        _, _, ids = _tokens(n, seed, experts)
        for e in ids.reshape(-1).tolist():
            per_rank[e // (E // size)] += 1
    stats = torch.load(tmp_path / "0.pt", weights_only=False)["stats"]
    mean, top = sum(per_rank) / size, max(per_rank)
    assert stats.max_sum == [top, top]
    assert stats.mean_sum == pytest.approx([mean, mean])
    assert stats.balance() == pytest.approx([mean / top] * 2)
    if size == 4:
        assert per_rank[3] == 0  # a rank that computed nothing

"""The KV-cache manager is the scheduler's one door to memory: the scheduler imports no pool,
block table or contiguous arena; the paged manager and the contiguous baseline both implement
the interface, answer "no room" without taking anything, and free every block they gave; the
prefix-cache accounting lives in the manager; `Scheduler.update_from_output` advances, publishes,
appends and frees as one protocol."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from jupyter_pagedkv.core.block_pool import BlockPool
from jupyter_pagedkv.core.contiguous import ContiguousKVCacheManager
from jupyter_pagedkv.core.invariants import check_invariants
from jupyter_pagedkv.core.kv_cache_manager import KVCacheManager, PagedKVCacheManager
from jupyter_pagedkv.core.sampling_params import SamplingParams
from jupyter_pagedkv.core.scheduler import SampledTokens, Scheduler
from jupyter_pagedkv.core.sequence import Sequence, SequenceStatus
from jupyter_pagedkv.core.swap_space import SwapSpace

SCHEDULER = Path(__file__).resolve().parents[2] / "jupyter_pagedkv" / "core" / "scheduler.py"
MEMORY_INTERNALS = {"block_pool", "block_table", "contiguous", "swap_space"}


def memory_imports(source: str) -> set[str]:
    """The memory-internal modules a source imports anywhere (functions and TYPE_CHECKING too)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            names = [*(node.module or "").split("."), *(a.name for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [part for a in node.names for part in a.name.split(".")]
        else:
            continue
        found.update(MEMORY_INTERNALS.intersection(names))
    return found


def test_the_scheduler_imports_no_pool_block_table_or_arena():
    assert memory_imports(SCHEDULER.read_text()) == set()


@pytest.mark.parametrize("planted", ["from .block_pool import NoFreeBlocksError",
                                     "from . import contiguous",
                                     "import jupyter_pagedkv.core.block_table",
                                     "if TYPE_CHECKING:\n    from .swap_space import SwapSpace"])
def test_a_planted_memory_import_in_the_scheduler_is_caught(planted):
    assert memory_imports(SCHEDULER.read_text() + "\n" + planted + "\n")


def test_the_scheduler_reaches_no_pool_or_arena_attribute():
    names = {n.attr for n in ast.walk(ast.parse(SCHEDULER.read_text())) if isinstance(n, ast.Attribute)}
    assert not names & {"pool", "arena", "block_table", "swap"}


# -- both managers, one interface ---------------------------------------------------------------
def paged(num_blocks: int = 8, block_size: int = 4, swap: SwapSpace | None = None) -> KVCacheManager:
    return PagedKVCacheManager(BlockPool(num_blocks, block_size), swap)


def contiguous(num_blocks: int = 8, block_size: int = 4, swap: SwapSpace | None = None) -> KVCacheManager:
    return ContiguousKVCacheManager(BlockPool(num_blocks, block_size, enable_prefix_caching=False), None, swap)


MANAGERS = [paged, contiguous]


def sequence(kv: KVCacheManager, rid: str, prompt: list[int], max_tokens: int = 4,
             tenant: str | None = None) -> Sequence:
    return Sequence(rid, list(prompt), len(prompt), SamplingParams(max_tokens=max_tokens),
                    kv.new_table(), 0.0, tenant=tenant)


def admit(kv: KVCacheManager, seq: Sequence, budget: int = 1 << 20) -> bool:
    seq.status = SequenceStatus.RUNNING
    return kv.admit(seq, kv.computed_blocks(seq, budget), [])


@pytest.mark.parametrize("make", MANAGERS)
def test_each_manager_implements_every_verb_of_the_interface(make):
    kv = make()
    assert isinstance(kv, KVCacheManager) and not inspect.isabstract(type(kv))
    for verb in ("computed_blocks", "admit", "extend_in_place", "allocate_slots", "blocks_needed", "free", "publish",
                 "fork", "swap_out", "swap_in", "roll_back", "fits", "num_held", "check_invariants"):
        assert callable(getattr(kv, verb)), verb
    assert kv.num_blocks == 8 and kv.block_size == 4 and kv.num_free == 8


@pytest.mark.parametrize("make", MANAGERS)
def test_extend_in_place_takes_no_block_and_refuses_what_needs_one(make):
    """Both managers: slots inside the blocks a sequence holds are taken without the pool; past
    them the answer is False, nothing changed (the contiguous reservation has room to max_tokens)."""
    kv = make()
    a = sequence(kv, "a", list(range(5)), max_tokens=3)          # 8 tokens at most: 2 blocks of 4
    assert admit(kv, a)
    free, blocks = kv.num_free, list(a.block_table.block_ids)
    assert kv.extend_in_place(a, 8) and a.block_table.num_slots == 8
    assert kv.num_free == free and a.block_table.block_ids == blocks
    assert not kv.extend_in_place(a, 9) and a.block_table.num_slots == 8
    kv.check_invariants([a])


@pytest.mark.parametrize("make", MANAGERS)
def test_no_room_is_answered_with_false_and_takes_nothing(make):
    kv = make(num_blocks=4)
    a = sequence(kv, "a", list(range(12)), max_tokens=4)         # 16 tokens: the whole pool
    assert admit(kv, a) and kv.allocate_slots(a, 16, [])
    held = (a.block_table.block_ids, a.block_table.num_slots)
    b = sequence(kv, "b", list(range(100, 104)))
    assert not admit(kv, b)
    assert b.block_table.blocks == [] and kv.num_free == 0
    assert not kv.fits(1)
    assert not kv.allocate_slots(a, 17, [])                        # past every block there is
    assert (a.block_table.block_ids, a.block_table.num_slots) == held
    kv.check_invariants([a, b])


@pytest.mark.parametrize("make", MANAGERS)
def test_a_stale_id_array_is_caught_by_the_invariant_checker(make):
    kv = make()
    seq = sequence(kv, "a", list(range(6)))
    assert admit(kv, seq) and kv.allocate_slots(seq, 9, [])
    kv.check_invariants([seq])
    seq.block_table.ids()[0] += 1           # a stale row: the step would stage another block
    with pytest.raises(AssertionError, match="invariant 5"):
        kv.check_invariants([seq])


@pytest.mark.parametrize("make", MANAGERS)
def test_free_returns_every_block_it_gave(make):
    kv = make()
    seqs = [sequence(kv, f"r{i}", list(range(10 * i, 10 * i + 5)), max_tokens=3) for i in range(3)]
    for seq in seqs:
        assert admit(kv, seq)
        assert kv.allocate_slots(seq, 7, [])
    assert kv.num_free < kv.num_blocks
    kv.check_invariants(seqs)
    for seq in seqs:
        kv.free(seq)
    assert kv.num_free == kv.num_blocks and kv.pool.num_used == 0
    assert all(s.block_table.blocks == [] for s in seqs)
    kv.check_invariants([])
    assert kv.free_runs() in (None, (kv.num_blocks,))              # the arena is one extent again


@pytest.mark.parametrize("make", MANAGERS)
def test_free_of_a_swapped_sequence_returns_its_host_slots(make):
    kv = make(swap=SwapSpace(8))
    seq = sequence(kv, "s", list(range(6)))
    assert admit(kv, seq)
    copies = kv.swap_out(seq)
    if copies is None:                      # the baseline never swaps: it recomputes
        assert isinstance(kv, ContiguousKVCacheManager)
        kv.free(seq)
    else:
        assert [slot for _, slot in copies] == seq.swap_slots and kv.swap.num_used == 2
        assert seq.block_table.blocks == [] and kv.num_free == kv.num_blocks
        seq.status = SequenceStatus.SWAPPED
        kv.check_invariants([seq])
        kv.free(seq)
        assert seq.swap_slots == []
    assert kv.swap.num_used == 0 and kv.num_free == kv.num_blocks


def test_a_slot_both_held_and_free_is_caught_by_the_invariant_checker():
    """Invariant 6 compares the slots themselves, not their counts: a held slot that is also on the
    free list (with another slot neither) keeps the counts equal and is still caught."""
    kv = paged(swap=SwapSpace(4))
    seq = sequence(kv, "s", list(range(6)))
    assert admit(kv, seq) and kv.swap_out(seq) is not None
    seq.status = SequenceStatus.SWAPPED
    kv.check_invariants([seq])
    lost = next(s for s in range(4) if s not in seq.swap_slots and s in kv.swap._free)
    kv.swap._free[kv.swap._free.index(lost)] = seq.swap_slots[0]   # a held slot freed, one lost
    with pytest.raises(AssertionError, match="invariant 6"):
        kv.check_invariants([seq])


def test_a_swapped_sequence_comes_back_with_its_slots():
    kv = paged(swap=SwapSpace(4))
    seq = sequence(kv, "s", list(range(6)))
    assert admit(kv, seq) and kv.allocate_slots(seq, 6, [])
    out = kv.swap_out(seq)
    assert kv.blocks_to_swap_in(seq, 7) == 2 and kv.fits(2)
    back = kv.swap_in(seq)
    assert [slot for slot, _ in back] == [slot for _, slot in out]
    assert seq.block_table.num_slots == 6 and len(seq.block_table.blocks) == 2 and kv.swap.num_used == 0


def test_the_prefix_cache_is_looked_up_and_counted_inside_the_manager():
    kv = paged(num_blocks=16)
    prompt = list(range(13))                                       # 3 full blocks and one token
    first = sequence(kv, "first", prompt, tenant="t")
    assert admit(kv, first)
    first.num_computed_tokens = 13
    kv.publish(first)
    second = sequence(kv, "second", prompt, tenant="u")
    found = kv.computed_blocks(second, 64)
    assert found.start == 12 and found.num_tokens == 1 and found.num_new_blocks == 1
    assert kv.pool.prefix_cache_queries == 12 and kv.pool.prefix_cache_hits == 0   # a lookup counts nothing
    assert admit(kv, second)
    assert second.num_computed_tokens == 12
    assert second.block_table.block_ids[:3] == first.block_table.block_ids[:3]
    assert (kv.pool.prefix_cache_queries, kv.pool.prefix_cache_hits) == (24, 12)
    assert kv.prefix_hits_by_tenant == {"t": 0, "u": 12}
    kv.check_invariants([first, second])


def test_a_block_offered_this_step_serves_a_later_admission_of_the_same_step():
    kv = paged(num_blocks=16)
    a = sequence(kv, "a", list(range(9)))
    assert admit(kv, a)
    kv.offer(a, 0, 9)                                              # blocks 0 and 1 are computed this step
    b = sequence(kv, "b", list(range(9)))
    assert kv.computed_blocks(b, 64).start == 8
    kv.begin_step()                                                # the next step forgets them
    assert kv.computed_blocks(b, 64).start == 0


def test_invariant_9_catches_prefix_counts_that_do_not_add_up():
    kv = paged()
    kv.pool.prefix_cache_hits += 4
    with pytest.raises(AssertionError, match="invariant 9"):
        kv.check_invariants([])


def test_the_baselines_rolled_back_drafts_keep_its_run_whole():
    kv = contiguous()
    seq = sequence(kv, "s", list(range(5)), max_tokens=7)          # a run of 3 blocks
    assert admit(kv, seq) and kv.allocate_slots(seq, 11, [])
    kv.roll_back(seq, 6)
    assert seq.block_table.num_slots == 6 and len(seq.block_table.blocks) == 3
    kv.check_invariants([seq])                                     # the arena still holds 3 blocks


# -- update_from_output ---------------------------------------------------------------------------
def test_update_from_output_advances_publishes_appends_and_frees():
    kv = paged(num_blocks=16)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    a = sequence(kv, "a", list(range(8)), max_tokens=2)
    b = sequence(kv, "b", list(range(50, 58)), max_tokens=1)
    for seq in (a, b):
        sched.add(seq)
    out = sched.schedule()
    calls = []

    def sample():
        calls.append((a.num_computed_tokens, b.num_computed_tokens))   # KV is committed first
        return [SampledTokens(a, [7]), SampledTokens(b, [9, 10])]

    def append(seq, token):
        seq.token_ids.append(token)
        if seq.num_output_tokens >= seq.params.max_tokens:
            sched.finish(seq, "length")

    assert sched.update_from_output(out, sample, append) == 2      # b finished after its first
    assert calls == [(8, 8)]
    assert a.token_ids[-1] == 7 and a.block_table.num_published == 2
    assert b.is_finished and b.output_token_ids == [9] and b.block_table.blocks == []
    assert kv.pool.num_cached == 2                                 # b's blocks stay as a cached prefix
    check_invariants(sched)


def test_update_from_output_commits_kept_drafts_once_their_tokens_are_in():
    kv = paged(num_blocks=16)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    seq = sequence(kv, "s", list(range(7)), max_tokens=8)
    sched.add(seq)
    out = sched.schedule()
    assert kv.allocate_slots(seq, 10, [])                          # slots for the drafts kept below
    taken = sched.update_from_output(out, lambda: [SampledTokens(seq, [1, 2, 3], 9)],
                                     lambda s, t: s.token_ids.append(t))
    assert taken == 3 and seq.num_tokens == 10 and seq.num_computed_tokens == 9
    assert seq.block_table.num_published == 2
    check_invariants(sched)


PACKAGE = SCHEDULER.parents[1]


@pytest.mark.parametrize("driver", ["engine/stepping.py", "sim/simulator.py"])
def test_the_engine_and_the_simulator_keep_no_copy_of_the_post_forward_bookkeeping(driver):
    tree = ast.parse((PACKAGE / driver).read_text())
    calls = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert "update_from_output" in calls
    assert not calls & {"publish", "cache_block", "cache_computed_blocks"}
    written = {t.attr for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AugAssign))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Attribute)}
    assert "num_computed_tokens" not in written


def test_the_simulator_steps_through_update_from_output(monkeypatch):
    from jupyter_pagedkv.sim.cost_model import CostModel, ModelCost
    from jupyter_pagedkv.sim.plan import MODELS
    from jupyter_pagedkv.sim.simulator import SimConfig, Simulator
    from jupyter_pagedkv.sim.workload import synthetic

    calls = []
    real = Scheduler.update_from_output
    monkeypatch.setattr(Scheduler, "update_from_output", lambda self, *a: calls.append(1) or real(self, *a))
    model = MODELS["Llama-3-8B"]
    sim = Simulator(SimConfig(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=256),
                    ModelCost.of(model), CostModel.for_gpu("H100-80GB", 1, num_layers=model.num_layers))
    result = sim.run(synthetic(6, seed=2, max_context=256))
    assert len(result.completion_order) == 6 and len(calls) == result.num_steps > 0

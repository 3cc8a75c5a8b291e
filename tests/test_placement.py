"""Placement: row ranges of tables, bin packing of dense parameters, whole tables packed onto few shards (pure
logic)."""

import random

import pytest

from paramserver.shards.client.placement import pack_whole, plan_dense, shard_loads, split_rows, spread_whole

SHARDS = ["shard0", "shard1", "shard2", "shard3"]


def spread(loads):
    return (max(loads.values()) - min(loads.values())) / max(loads.values())


@pytest.mark.parametrize("num_rows", [1, 3, 4, 10, 10_000_001])
def test_split_rows_covers_the_table_evenly(num_rows):
    ranges = split_rows(num_rows, SHARDS)
    assert ranges[0].start == 0 and ranges[-1].stop == num_rows
    assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))
    sizes = [r.num_rows for r in ranges]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert [r.shard for r in ranges] == SHARDS[:len(ranges)]


def test_split_rows_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one row"):
        split_rows(0, SHARDS)
    with pytest.raises(ValueError, match="at least one shard"):
        split_rows(5, [])
    with pytest.raises(ValueError, match="unique"):
        split_rows(5, ["a", "a"])


def test_64_equal_parameters_balance_exactly():
    sizes = {f"p{i}": 256 * 256 * 4 for i in range(64)}
    plan = plan_dense(sizes, SHARDS)
    assert set(plan) == set(sizes)
    assert spread(shard_loads(plan, sizes, SHARDS)) == 0


@pytest.mark.parametrize("seed", range(20))
def test_mixed_sizes_stay_within_ten_percent(seed):
    rng = random.Random(seed)
    # A model-like mix: a few big matrices, many biases and mid-size layers.
    sizes = {f"p{i}": rng.choice([4 * 1024, 4 * 256 * 256, 4 * 1024 * 512, 4 * rng.randint(1, 300_000)])
             for i in range(rng.randint(12, 80))}
    plan = plan_dense(sizes, SHARDS)
    assert spread(shard_loads(plan, sizes, SHARDS)) <= 0.10


def test_greedy_alone_is_not_enough_but_the_swaps_fix_it():
    # Largest-first greedy puts 3+2 and 2+2+... badly here; the swap pass evens it out.
    sizes = {"a": 3, "b": 3, "c": 2, "d": 2, "e": 2}
    loads = shard_loads(plan_dense(sizes, ["x", "y"]), sizes, ["x", "y"])
    assert sorted(loads.values()) == [6, 6]


def test_a_parameter_bigger_than_the_rest_gets_a_shard_to_itself():
    sizes = {"huge": 1000, **{f"small{i}": 10 for i in range(30)}}
    plan = plan_dense(sizes, SHARDS)
    huge_shard = plan["huge"]
    assert [name for name, shard in plan.items() if shard == huge_shard] == ["huge"]
    others = {s: l for s, l in shard_loads(plan, sizes, SHARDS).items() if s != huge_shard}
    assert spread(others) <= 0.10


def test_existing_load_is_filled_around():
    sizes = {f"p{i}": 100 for i in range(8)}
    initial = {"shard0": 400}
    plan = plan_dense(sizes, SHARDS, initial_load=initial)
    assert "shard0" not in plan.values()
    loads = shard_loads(plan, sizes, SHARDS, initial)
    assert sorted(loads.values()) == [200, 300, 300, 400]


def test_plan_is_deterministic_and_rejects_bad_sizes():
    sizes = {f"p{i}": (i * 7919) % 1000 for i in range(40)}
    assert plan_dense(sizes, SHARDS) == plan_dense(dict(reversed(list(sizes.items()))), SHARDS)
    with pytest.raises(ValueError, match="'bad' has a negative size"):
        plan_dense({"bad": -1}, SHARDS)


def test_whole_tables_pack_onto_few_shards_no_fuller_than_the_balanced_plan():
    # The default job's tables (rows x 16 floats): the largest alone, the seven others together.
    sizes = {f"t{i}": rows * 64 for i, rows in enumerate((100_000, 20_000, 10_000, 5_000, 1_000, 500, 100, 20))}
    packed, balanced = pack_whole(sizes, SHARDS), plan_dense(sizes, SHARDS)
    assert len(set(balanced.values())) == 4 and set(packed.values()) == {"shard0", "shard1"}
    assert max(shard_loads(packed, sizes, SHARDS).values()) <= max(shard_loads(balanced, sizes, SHARDS).values())
    # Equal tables: as many on one shard as the balanced plan's fullest holds.
    equal = {f"e{i}": 10 for i in range(6)}
    loads = shard_loads(pack_whole(equal, SHARDS), equal, SHARDS)
    assert max(loads.values()) <= max(shard_loads(plan_dense(equal, SHARDS), equal, SHARDS).values())
    assert sum(1 for load in loads.values() if load) < 4
    assert pack_whole(sizes, SHARDS) == pack_whole(dict(reversed(list(sizes.items()))), SHARDS)  # deterministic


def test_a_trainers_whole_tables_go_packed_by_default_or_spread_over_every_shard():
    from paramserver.train.sparse import place_whole
    sizes = {f"t{i}": rows * 64 for i, rows in enumerate((100_000, 20_000, 10_000, 5_000, 1_000, 500, 100, 20))}
    assert place_whole(sizes, SHARDS, "packed") == pack_whole(sizes, SHARDS)
    # Spread: two tables on each shard, largest first to the shard holding the fewest (then the fewest bytes),
    # where packed puts seven of the eight on shard1.
    assert place_whole(sizes, SHARDS, "spread") == spread_whole(sizes, SHARDS) == {
        "t0": "shard0", "t1": "shard1", "t2": "shard2", "t3": "shard3",
        "t4": "shard3", "t5": "shard2", "t6": "shard1", "t7": "shard0"}
    seven = {f"s{i}": 10 for i in range(7)}
    counts = [list(spread_whole(seven, SHARDS).values()).count(shard) for shard in SHARDS]
    assert sorted(counts) == [1, 2, 2, 2]
    assert spread_whole(sizes, SHARDS) == spread_whole(dict(reversed(list(sizes.items()))), SHARDS)  # deterministic
    assert place_whole({}, SHARDS, "spread") == {}
    with pytest.raises(ValueError, match="'bad' has a negative size"):
        spread_whole({"bad": -1}, SHARDS)
    with pytest.raises(ValueError, match=r"table_placement must be one of \('packed', 'spread'\), got 'even'"):
        place_whole(sizes, SHARDS, "even")

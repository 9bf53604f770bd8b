"""remat.prove.collectives: what is counted, and that a wrapper around a collective counts once."""
import warnings

import pytest
import torch
import torch.distributed as dist

from remat.prove.collectives import CollectiveCounter, count_events


class _Event:
    def __init__(self, name, start, duration, thread=1):
        self._args = name, start, duration, thread

    def name(self):
        return self._args[0]

    def start_ns(self):
        return self._args[1]

    def duration_ns(self):
        return self._args[2]

    def start_thread_id(self):
        return self._args[3]


def test_count_events_counts_the_outermost_c10d_operator():
    events = [
        _Event("aten::mm", 0, 5),
        _Event("_c10d_functional::all_gather_into_tensor", 10, 20),
        _Event("c10d::allgather_into_tensor_coalesced_", 11, 15),  # what the functional op runs
        _Event("c10d::_allgather_base_", 40, 5),
        _Event("gloo:all_gather", 41, 2),  # the backend's own work: not a call
        _Event("c10d::_reduce_scatter_base_", 50, 5),
        _Event("c10d::allreduce_", 52, 5, thread=2),  # another thread (DDP's reducer): counted
        _Event("c10d::broadcast_", 60, 1),
        _Event("c10d::check_for_nan", 70, 1),
    ]
    counts = count_events(events)
    assert (counts.all_gather, counts.reduce_scatter, counts.all_reduce, counts.other) == (2, 1, 1, 1)
    assert counts.by_op["c10d::_allgather_base_"] == 1 and "c10d::check_for_nan" not in counts.by_op
    assert counts.per_step(2)["all_gather"] == 1


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built")
def test_counter_on_a_one_rank_gloo_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        import torch.distributed._functional_collectives as funcol
        with CollectiveCounter() as counter:
            t = torch.ones(4)
            dist.all_reduce(t)
            dist.all_reduce(t)
            out = torch.empty(4)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # all_gather_into_tensor is deprecated in newer torch
                dist.all_gather_into_tensor(out, t)
            funcol.wait_tensor(funcol.all_reduce(t, "sum", dist.group.WORLD))
            dist.broadcast(t, src=0)
        c = counter.counts
        assert (c.all_gather, c.all_reduce, c.reduce_scatter, c.other) == (1, 3, 0, 1), c.by_op
        assert c.as_dict()["by_op"] == dict(c.by_op)
    finally:
        dist.destroy_process_group()

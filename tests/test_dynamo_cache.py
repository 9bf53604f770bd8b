"""remat.treat.dynamo_cache: remat's compiles leave dynamo's cache as they found it, the user's graphs included."""
import warnings

import pytest
import torch

from remat.treat import dynamo_cache
from remat.treat.dynamo_cache import compiled, own_compiles

pytest.importorskip("torch._dynamo")
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list  # noqa: E402


class _Counter:
    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def _live(code) -> int:
    return sum(e.code is not None for e in _debug_get_cache_entry_list(code))


def users_function(x):
    return x.sin() + 1


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x).relu()


def test_remats_compiles_are_gone_and_the_users_stay():
    user = _Counter()
    users = torch.compile(users_function, backend=user, dynamic=False)
    x = torch.randn(3)
    users(x)
    assert user.graphs == 1 and _live(users_function.__code__) == 1
    block = _Block()
    block.compile(backend=_Counter())
    block(torch.randn(2, 4))
    blocks_before = _live(torch.nn.Module._call_impl.__code__) + _live(torch.nn.Module._wrapped_call_impl.__code__)
    remats = _Counter()
    with own_compiles():
        call = compiled(backend=remats, dynamic=False)
        others = [_Block() for _ in range(3)]
        for other in others:
            call.bind(other)(torch.randn(2, 4)).sum().backward()
        torch.compile(users_function, backend=remats, dynamic=False, **dynamo_cache.compile_options())(x)
        trampoline = call.code
    assert remats.graphs == 2, "one graph for the three blocks (the module is an argument), one for the function"
    assert _debug_get_cache_entry_list(trampoline) == []
    assert _live(users_function.__code__) == 1
    assert _live(torch.nn.Module._call_impl.__code__) + _live(torch.nn.Module._wrapped_call_impl.__code__) \
        == blocks_before
    users(x)
    block(torch.randn(2, 4))
    assert user.graphs == 1, "the user's graph was kept: no recompile"


@pytest.mark.skipif(not dynamo_cache.isolating(), reason="this torch has no isolate_recompiles")
def test_remats_entries_on_a_users_function_do_not_count_against_its_recompile_limit():
    def function(x):
        return x.cos() * 2
    user = _Counter()
    users = torch.compile(function, backend=user, dynamic=False)
    users(torch.randn(1))
    with torch._dynamo.config.patch(recompile_limit=3):
        with own_compiles():
            remats = torch.compile(function, backend=_Counter(), dynamic=False, **dynamo_cache.compile_options())
            for n in (2, 3):
                remats(torch.randn(n))
        for n in (4, 5):
            users(torch.randn(n))
    assert user.graphs == 3, "the user's region still had room for its own recompiles"


def test_a_compile_outside_remats_region_on_a_users_function_resets_it_and_says_so():
    def function(x):
        return x.tan()
    user = _Counter()
    users = torch.compile(function, backend=user, dynamic=False)
    users(torch.randn(2))
    with pytest.warns(RuntimeWarning, match="function"):
        with own_compiles("test"):
            torch.compile(function, backend=_Counter(), dynamic=False)(torch.randn(2))
    assert _live(function.__code__) == 0
    users(torch.randn(2))
    assert user.graphs == 2, "reset: the user's graph recompiled, as the warning said"


def test_nothing_compiled_nothing_touched():
    user = _Counter()
    users = torch.compile(users_function, backend=user, dynamic=False)
    users(torch.randn(5))
    before = _live(users_function.__code__)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with own_compiles():
            pass
    assert _live(users_function.__code__) == before

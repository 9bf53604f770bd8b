"""The fake profile's kernel memo and metadata pass-through (remat.profiling._fake_memo, _meters): a
profile made with them equals one made without, and the memo is used (a memo that never hits fails);
a replayed view starts where the view op would start it, on its base's storage."""
import dataclasses

import torch

import remat
from remat.presets import build_model, load_config
# private: the memo has no public switch (the test turns its replay off to compare); the byte tracker
# and fake mode are what a fake profile runs under, read here op by op
from remat.profiling import _fake_memo
from remat.profiling._fake import ValuedFakeMode
from remat.profiling._meters import _Tracker


def _profile_without_seconds(model, ids):
    prof = remat.profile(model, ids, device="fake")
    return dataclasses.replace(prof, notes={k: v for k, v in prof.notes.items() if k != "profile_seconds"})


def test_the_memo_replays_repeated_ops_and_changes_no_number(monkeypatch):
    config = load_config("llama-tiny")
    config.num_hidden_layers = 2
    config.use_cache = True  # as from_pretrained gives it (the presets leave it off)
    torch.manual_seed(0)
    model = build_model(config, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, config.vocab_size, (2, 32))
    hits = {"replay": [], "replay_view": []}
    for name in hits:
        def counted(self, *args, _replay=getattr(_fake_memo.KernelMemo, name), _hits=hits[name]):
            out = _replay(self, *args)
            _hits.append(out is not None)
            return out
        monkeypatch.setattr(_fake_memo.KernelMemo, name, counted)
    memoised = _profile_without_seconds(model, ids)
    assert sum(hits["replay"]) > 0 and sum(hits["replay_view"]) > 0
    monkeypatch.setattr(_fake_memo.KernelMemo, "replay", lambda self, key: None)
    monkeypatch.setattr(_fake_memo.KernelMemo, "replay_view", lambda self, key, base: None)
    assert repr(_profile_without_seconds(model, ids)) == repr(memoised)


def test_a_replayed_view_starts_past_its_own_base_on_its_storage():
    """One key for ``select(0, 3)`` of two bases that start at different offsets of one storage: the
    second (a replay) starts 3 rows past its own base, as the op would; ``as_strided``, whose offset is
    absolute, is never memoised."""
    mode = ValuedFakeMode()
    with mode:
        whole = torch.empty(4, 8, 16)
        first, second = whole[1], whole[2]
        a = first.select(0, 3)
        replays = len(mode._memo.views)
        b = second.select(0, 3)
        assert len(mode._memo.views) == replays   # no new entry: the second was a replay
        assert mode._memo.replay_view(mode._memo.key(torch.ops.aten.select.int, (second, 0, 3), {}), second) is not None
        assert (a.storage_offset(), b.storage_offset()) == (1 * 128 + 3 * 16, 2 * 128 + 3 * 16)
        assert b.untyped_storage() is whole.untyped_storage() and b.shape == (16,) and b.stride() == (1,)
        strided = [whole.as_strided((2, 2), (1, 1), offset) for offset in (5, 9)]
        assert [t.storage_offset() for t in strided] == [5, 9]
    assert not _fake_memo.plain_view(torch.ops.aten.as_strided.default)
    assert _fake_memo.plain_view(torch.ops.aten.select.int) and not _fake_memo.plain_view(torch.ops.aten.add_.Tensor)


def test_views_cost_nothing_but_a_real_constant_the_fake_mode_converts_is_counted():
    """Views pass the byte tracker without bookkeeping, except a view whose output is not its input's
    storage: ``torch.tensor`` in a model's forward lifts a real constant (``lift_fresh``, a view op by
    its schema) into a new fake storage, which the tracker must count."""
    from remat.planning.costs import rates_for
    rates = rates_for("h100")
    tracker = _Tracker(rates)
    with ValuedFakeMode(), tracker:
        x = torch.tensor([1.0, 2.0, 3.0] * 100)   # 1,200 bytes
        lifted = tracker.current
        x.view(10, 30).t().unsqueeze(0)
        assert tracker.current == lifted
    granularity = rates.granularity
    assert lifted == -(-1200 // granularity) * granularity

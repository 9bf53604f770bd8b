"""The fake profile's kernel memo and metadata pass-through (remat.profiling._fake_memo, _meters): a
profile made with them equals one made without, and the memo is used (a memo that never hits fails)."""
import dataclasses

import torch

import remat
from remat.presets import build_model, load_config
# private: the memo has no public switch; the test turns its replay off to compare
from remat.profiling import _fake_memo


def _profile_without_seconds(model, ids):
    prof = remat.profile(model, ids, device="fake")
    return dataclasses.replace(prof, notes={k: v for k, v in prof.notes.items() if k != "profile_seconds"})


def test_the_memo_replays_repeated_ops_and_changes_no_number(monkeypatch):
    config = load_config("llama-tiny")
    config.num_hidden_layers = 2
    torch.manual_seed(0)
    model = build_model(config, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, config.vocab_size, (2, 32))
    hits = []
    replay = _fake_memo.KernelMemo.replay

    def counted(self, key):
        out = replay(self, key)
        hits.append(out is not None)
        return out
    monkeypatch.setattr(_fake_memo.KernelMemo, "replay", counted)
    memoised = _profile_without_seconds(model, ids)
    assert sum(hits) > 0
    monkeypatch.setattr(_fake_memo.KernelMemo, "replay", lambda self, key: None)
    assert repr(_profile_without_seconds(model, ids)) == repr(memoised)

"""Every code block of docs/integrations.md and of the README's "Integrations" section runs, as
written, on a tiny Llama on the CPU.

Python blocks get fresh stand-ins for the reader's objects (``model``, ``train_dataset``,
``dataset``, ``tokenizer``, ``lit_module``, ``train_loader``, ``batch``, ``args``) and run in a
temporary folder (they write ``out/``); a ``remat ...`` shell line runs its command module
in-process. A block whose library is not installed is skipped, naming it.

One thing differs from a user's run: accelerate's process-wide state is reset before each block
(an earlier Trainer in this process fixed its precision). The TRL block runs as written: it asks
for bf16 only where a GPU is (TRL's default ``bf16=True`` is refused on a CPU).
"""
import os
import re
import shlex
import warnings

import pytest
import torch

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
DOC = os.path.join(ROOT, "docs", "integrations.md")
README = os.path.join(ROOT, "README.md")


def _blocks():
    with open(DOC) as f:
        text = f.read()
    with open(README) as f:
        readme = f.read()
    section = readme.split("\n## Integrations\n", 1)[1].split("\n## ", 1)[0]
    return [(lang, code) for lang, code in re.findall(r"```(python|bash)\n(.*?)```", text + section, re.S)]


BLOCKS = _blocks()


def _namespace():
    from test_integrations_hf import TokenData, _batch_for_docs, tiny_llama
    namespace = {"model": tiny_llama().train(), "train_dataset": TokenData(count=4), "batch": _batch_for_docs()}
    namespace["args"] = None
    return namespace


def _trl_objects(namespace):
    from test_integrations_trl import _data, _tokenizer
    namespace.update(dataset=_data().select(range(4)), tokenizer=_tokenizer())


def _lightning_objects(namespace):
    from test_integrations_lightning import LitLM, _loader
    namespace.update(lit_module=LitLM(), train_loader=_loader())


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[f"block{i}-{lang}" for i, (lang, _) in enumerate(BLOCKS)])
def test_doc_block_runs(index, tmp_path, monkeypatch, capsys):
    lang, code = BLOCKS[index]
    monkeypatch.chdir(tmp_path)
    if lang == "bash":
        from remat.cli import main
        for line in code.strip().splitlines():
            argv = shlex.split(line)
            assert argv[0] == "remat"
            status = main(argv[1:])
            assert status == 0, capsys.readouterr()
        return
    for library in ("trl", "lightning", "accelerate"):
        if re.search(rf"^(from|import) {library}\b", code, re.M):
            pytest.importorskip(library, reason=f"{library} is not installed")
    namespace = _namespace()
    if "trl" in code:
        _trl_objects(namespace)
    if "lightning" in code:
        _lightning_objects(namespace)
    if "training_args=args" in code:
        from test_doctor import _args
        namespace["args"] = _args(tmp_path)
    _reset_accelerate()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, f"integrations-block{index}", "exec"), namespace)


def _reset_accelerate():
    try:
        from accelerate.state import AcceleratorState
    except ImportError:
        return
    AcceleratorState._reset_state(reset_partial_state=True)


def test_every_block_is_found():
    assert [lang for lang, _ in BLOCKS].count("python") == 12 and [lang for lang, _ in BLOCKS].count("bash") == 3

"""A newcomer's first hour (issue 45): bad input refused in one line before anything slow runs, and
nothing that happens without a word (a long plan, a re-plan, a hook's value read, a warning no one
can act on)."""
import argparse
import time
import warnings

import pytest
import torch

import remat
from remat.planner import check_batch, position_limit


def _llama(vocab=64, positions=16):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions)
    return LlamaForCausalLM(config)


def _gpt2(positions=32):
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=positions, n_embd=32, n_layer=2, n_head=2))


def test_plan_of_something_that_is_not_a_module_is_a_type_error():
    with pytest.raises(TypeError, match=r"remat.plan expects a torch.nn.Module as its first argument, got str"):
        remat.plan("model", torch.zeros(2, 8, dtype=torch.long), budget="1GiB")
    with pytest.raises(TypeError, match=r"remat.profile expects a torch.nn.Module as its first argument, got str"):
        remat.profile("model", torch.zeros(2, 8, dtype=torch.long))


@pytest.mark.parametrize("key, value, match", [
    ("input_ids", 64, r"input_ids holds the token id 64, outside LlamaForCausalLM's vocabulary of 64 ids"),
    ("input_ids", -1, r"token id -1"),
    ("labels", 70, r"labels holds the token id 70.*labels ignored by the loss are -100"),
])
def test_token_ids_outside_the_vocabulary_are_refused_before_profiling(key, value, match):
    model = _llama()
    batch = {"input_ids": torch.randint(0, 64, (2, 8)), "labels": torch.randint(0, 64, (2, 8))}
    batch[key][1, 3] = value
    with pytest.raises(ValueError, match=match):
        remat.plan(model, batch, budget="1GiB")
    with pytest.raises(IndexError if key == "input_ids" else (IndexError, RuntimeError)):
        model(**batch)  # what the check saves the user from: a real step fails there


def test_labels_the_loss_ignores_and_meta_batches_pass():
    model = _llama()
    labels = torch.randint(0, 64, (2, 8))
    labels[:, :3] = -100
    check_batch(model, {"input_ids": torch.randint(0, 64, (2, 8)), "labels": labels})
    check_batch(model, torch.zeros(2, 8, dtype=torch.long, device="meta"))  # no values to read
    labels[0, 0] = -1  # a loss_fn of the caller's may ignore other labels than the model's loss does
    check_batch(model, {"input_ids": torch.randint(0, 64, (2, 8)), "labels": labels}, labels=False)


def test_gpt2_past_its_position_table_is_refused_and_up_to_it_runs():
    model = _gpt2(positions=32)
    assert position_limit(model) == (32, "transformer.wpe: n_positions 32")
    with pytest.raises(ValueError, match=r"input_ids holds sequences of 33 tokens, longer than the 32 positions "
                                         r"GPT2LMHeadModel has \(transformer.wpe: n_positions 32\)"):
        remat.plan(model, torch.zeros(1, 33, dtype=torch.long), budget="1GiB")
    with pytest.raises(IndexError):
        model(torch.zeros(1, 33, dtype=torch.long))
    check_batch(model, torch.zeros(1, 32, dtype=torch.long))
    model(torch.zeros(1, 32, dtype=torch.long))


def test_a_rotary_model_is_not_limited_by_max_position_embeddings():
    model = _llama(positions=16)
    assert position_limit(model) is None
    check_batch(model, torch.zeros(1, 64, dtype=torch.long))
    model(torch.zeros(1, 64, dtype=torch.long))  # RoPE runs past it: refusing would be wrong


def test_roberta_positions_start_after_its_padding_row():
    from transformers import RobertaConfig, RobertaForMaskedLM
    model = RobertaForMaskedLM(RobertaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=32, max_position_embeddings=20))
    assert position_limit(model)[0] == 18
    model(torch.full((1, 18), 5))
    with pytest.raises((IndexError, RuntimeError)):
        model(torch.full((1, 19), 5))


def test_remat_plan_refuses_a_seq_past_the_positions_in_one_line(tmp_path, capsys):
    from remat.cli import main
    path = tmp_path / "gpt2.json"
    _gpt2(positions=1024).config.to_json_file(str(path))
    assert main(["plan", "--model", str(path), "--batch", "1", "--seq", "2048", "--budget", "4GiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("remat plan: error: --seq 2,048 is longer than the 1,024 positions")


def test_a_batch_that_takes_minutes_to_plan_says_so_before_it_starts():
    from remat.cli.plan import planning_notice
    args = argparse.Namespace(batch=1, seq=100_000_000, cp=1)
    notice = planning_notice(args)
    assert "100,000,000 tokens a step" in notice and "183,109 chunks at 4 chunk sizes" in notice
    assert "minutes" in notice and "still" not in notice
    assert planning_notice(argparse.Namespace(batch=4, seq=4096, cp=1)) is None


def test_a_stage_still_running_is_said_again():
    from remat.cli.plan import heartbeat
    said = []
    with heartbeat(said.append, every_s=0.05) as say:
        say("profiling embeddings and head: chunked (1024 tokens)")
        time.sleep(0.4)
    assert said[0] == "profiling embeddings and head: chunked (1024 tokens)"
    assert any(line.startswith("still profiling embeddings and head: chunked (1024 tokens) after ") for line in said)


def test_first_n_past_the_blocks_is_an_error_naming_them():
    from remat.planning.plans import resolve
    names = [f"model.layers.{i}" for i in range(4)]
    with pytest.raises(ValueError, match=r"first 8 blocks, but the model has 4 \(model.layers.0 .. model.layers.3\); "
                                         r"pass 'first:4:selective' or 'selective'"):
        resolve("first:8:selective", names)
    assert set(resolve("first:4", names).blocks.values()) == {"full"}


def test_host_memory_help_says_what_the_code_does():
    from remat.cli import plan as cli_plan
    parser = argparse.ArgumentParser()
    cli_plan.add_arguments(parser)
    text = parser.format_help()
    assert "60%" not in text and "default: no limit" in " ".join(text.split())


def test_a_hook_that_reads_the_loss_is_named_not_a_loss_fn():
    model = _llama()
    seen = []
    model.register_forward_hook(lambda module, args, out: seen.append(out.loss.item()))
    with pytest.raises(ValueError) as raised:
        remat.profile(model, torch.randint(0, 64, (2, 8)), gpu="h100", head_modes=("plain",))
    message = str(raised.value)
    assert "the forward hook <lambda> on the model (LlamaForCausalLM; " in message
    assert "test_first_hour.py" in message and "out.loss.item()" in message
    assert "torch._subclasses.FakeTensor" in message and "loss_fn" not in message


def test_a_cache_the_model_builds_itself_is_not_warned_of(monkeypatch):
    from remat.treat import cache_layout
    monkeypatch.setattr(cache_layout, "_WARNED", set())
    model = _llama()
    assert model.config.use_cache
    remat.apply(model, "every:2")
    ids = torch.randint(0, 64, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(ids, labels=ids).loss.backward()


def test_a_cache_that_holds_tokens_is_read_as_the_untouched_model_reads_it():
    """A training forward handed a cache of earlier tokens: the treated blocks attend over them (their
    view of the cache), so the loss is the untouched model's, where it once crashed or was warned of."""
    import copy
    model = _llama()
    reference = copy.deepcopy(model)
    remat.apply(model, "full")
    ids, prefix = torch.randint(0, 64, (1, 4)), torch.randint(0, 64, (1, 5))
    losses = []
    for m in (model, reference):
        with torch.no_grad():
            cache = m(prefix, use_cache=True).past_key_values
        losses.append(m(ids, labels=ids, past_key_values=cache).loss)
    assert torch.equal(losses[0], losses[1])

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/families.py

# One torch thread per test process, unless the caller chose: the tests run tiny models, whose ops are
# too small to split, and `make test`'s two workers on two cores would each start a thread per core
# that spins while it waits. Measured on the 2-core machine (tests/test_tiled.py, -n 2): 113-144 s
# wall and 45 s of CPU with torch's default, 39-41 s and 15 s with one thread (2026-12-02).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# `make test` runs `-m "not slow"`; `make test-slow` runs `-m slow` and `make test-all` runs both (then the
# zoo). Tests that take minutes carry `@pytest.mark.slow` in their own files; these are marked here
# instead, so their files stay as they are. An entry is "file::test" (every case of it) or
# "file::test[id]" (one case); KEEP_FAST names the cases of a whole-test entry that stay in `make test`,
# so that every file keeps a fast representative. Seconds: `pytest -n 2 --durations` on a loaded 2-core
# machine (about 2.5x CI's), each test with its setup.
SLOW = {
    # ~660 s for 37 models (~14 s each); every model's treatments stay fast in test_treatment_is_exact
    "test_zoo.py::test_plans_on_fake_tensors": "one fake-tensor plan per zoo model; llama stays fast",
    "test_plan_compile.py::test_compile_branch_compiles_once_per_class_treatment_and_head":
        "241 s: aot_eager compiles every class x treatment x head on the CPU; "
        "test_blocks_scope_profiles_the_blocks_compiled_and_the_head_eager keeps the compile branch fast",
    "test_plan_compile.py::test_a_compiled_plan_measured_under_its_budget_is_returned_as_solved":
        "17 s: the measuring loop stays fast in ..._measured_over_its_budget_is_solved_again...",
    "test_plan_compile.py::test_compiled_plans_over_the_budget_every_time_raise_naming_the_lowest_measured_peak":
        "14 s: as above",
    "test_newcomer.py::test_doctor_agrees_with_estimate_to_the_byte_and_never_calls_an_oom_slower":
        "68 s: doctor stays fast in test_doctor.py and test_doctor_cli_reports_an_untouched_model...",
    "test_newcomer.py::test_doctor_judges_the_plan_a_callback_will_make": "65 s: as above",
    "test_newcomer.py::test_a_callback_budget_nothing_fits_stops_as_remat_plan_does":
        "49 s: a full Trainer run; test_integrations_hf.py keeps the callback fast",
    "test_planner.py::test_solver_is_optimal_against_brute_force":
        "69 s: test_one_dp_both_objectives_against_brute_force and test_solver_exact.py stay fast",
    "test_planner.py::test_predicted_peak_matches_measured_cpu[qwen-keep]":
        "41 s (profiles the qwen fixture): the llama row checks every spec fast",
    "test_planner.py::test_predicted_peak_matches_measured_cpu[qwen-full]": "the qwen row, as above",
    "test_planner.py::test_predicted_peak_matches_measured_cpu[qwen-selective]": "the qwen row",
    "test_planner.py::test_predicted_peak_matches_measured_cpu[qwen-attention]": "the qwen row",
    "test_planner.py::test_predicted_peak_matches_measured_cpu[qwen-mlp]": "the qwen row",
    "test_planner.py::test_predicted_peak_matches_measured_cpu[qwen-every:2]": "the qwen row",
    "test_planner.py::test_predicted_peak_matches_measured_cpu[qwen-first:1:selective]": "the qwen row",
    "test_host_memory.py::test_remat_plan_says_the_host_memory_a_plan_needs":
        "77 s: the host-memory budget stays fast in test_a_plan_offloads_no_more_than_the_host_gives",
    "test_head_seq2seq.py::test_plan_chooses_the_chunked_head_where_only_it_fits":
        "69 s: every family's chunked head stays fast in test_fp32_loss_and_every_gradient_match_the_model",
    "test_vlm_plan.py::test_planned_on_the_cpu_covering_vision_and_language_blocks_and_leaving_the_model_as_found[qwen2_vl]":
        "33 s: llava stays fast",
    "test_vlm_plan.py::test_planned_on_the_cpu_covering_vision_and_language_blocks_and_leaving_the_model_as_found[paligemma]":
        "33 s: llava stays fast",
    "test_vlm_plan.py::test_predicted_bytes_kept_by_each_block_are_what_its_saved_tensors_hold[llava]":
        "25 s: paligemma stays fast",
    "test_vlm_plan.py::test_predicted_bytes_kept_by_each_block_are_what_its_saved_tensors_hold[qwen2_vl]":
        "15 s: paligemma stays fast",
    "test_vlm_plan.py::test_remat_plan_takes_a_vlm_config_json":
        "18 s: test_remat_plan_takes_the_qwen2_vl_preset_... keeps `remat plan --images` fast",
    "test_integrations_hf_oom.py::test_trainer_redoes_an_out_of_memory_micro_batch[backward]":
        "35 s: [forward] stays fast",
    "test_integrations_hf_oom.py::test_trainer_gives_up_after_max_retries": "31 s: as above",
    # the three share one module fixture that starts 3 torchrun launches (6 processes) at once: all or none
    "test_distributed_scripts.py::test_train_fsdp_example_under_torchrun":
        "39 s of launches: FSDP2 and DDP stay fast in-process (test_fsdp.py, test_ddp_model.py), as do "
        "--plan-only and the trace breakdown here",
    "test_distributed_scripts.py::test_fsdp_bench_cpu_path": "the same launches",
    "test_distributed_scripts.py::test_ddp_bench_cpu_path": "the same launches",
    # ~95 s for 12 cases; llama's two stay fast
    "test_mask_skip.py::test_families_compile_with_eagers_loss_and_gradients": "one compile per family",
    "test_integrations_lightning.py::test_budget_plans_from_real_batches_and_replans_on_a_longer_one":
        "32 s: the HF callback's budget test (test_integrations_hf.py) stays fast, as do Lightning's others",
    "test_integrations_hf.py::test_watcher_replans_only_on_longer_batches":
        "32 s: test_callback_plans_from_the_first_real_batch_and_replans_on_a_longer_one stays fast",
    "test_profiling_peft.py::test_lora_over_frozen_embeddings_plans_both_heads":
        "27 s: test_a_base_model_plan_applies_to_its_peft_wrapper_and_back stays fast",
    "test_tiled.py::test_the_planner_tiles_where_block_insides_set_the_floor":
        "22 s: the tiled treatments stay fast in test_tiled_matches_the_untouched_model",
    # second pass, by CPU seconds (a per-test process_time() run: wall seconds on the shared machine
    # swung 2-5x with the load); each keeps a sibling fast
    "test_guard.py::test_gives_up_with_the_budgets_tried": "13 CPU s: test_injected_oom_is_recovered... stays fast",
    "test_guard.py::test_plans_after_the_first_are_profiled_on_fake_tensors":
        "12 CPU s: test_longer_batches_are_planned_before_they_run stays fast",
    "test_cli_examples.py::test_example_runs[remat bench --only eager,hf_full,remat:full,remat:selective]":
        "28 CPU s: `remat bench --only eager,remat:full --json` stays fast",
    "test_planner.py::test_cli_plan_llama_8b_writes_a_loadable_plan":
        "14 CPU s: `remat plan` stays fast in test_cli.py and the llama-tiny CLI examples",
    "test_planner.py::test_optimizer_state_follows_the_parameter_dtype[float32-8]": "8 CPU s: [bfloat16-4] stays fast",
    "test_doctor.py::test_a_compiled_plan_of_the_other_scope":
        "13 CPU s: test_an_eager_plan_on_a_compiled_model keeps doctor's compile checks fast",
    "test_doctor.py::test_segments_plans_are_not_simulated": "10 CPU s: doctor's other checks stay fast",
    "test_architectures.py::test_plans_where_the_profile_used_to_crash[longt5]": "11 CPU s: recurrent_gemma stays fast",
    "test_architectures.py::test_plans_where_the_profile_used_to_crash[swinv2]": "11 CPU s: as above",
    "test_architectures.py::test_plans_where_the_profile_used_to_crash[focalnet]": "8 CPU s: as above",
    "test_vlm_plan.py::test_an_applied_plan_recomputes_and_gives_the_untouched_models_gradients[qwen2_vl]":
        "11 CPU s: llava stays fast",
    "test_vlm_plan.py::test_an_applied_plan_recomputes_and_gives_the_untouched_models_gradients[paligemma]":
        "9 CPU s: llava stays fast",
    "test_cli.py::test_plan_compile_builds_on_the_gpu_and_says_the_plan_is_for_compile[flag1-blocks-block.compile() on each block]":
        "6 CPU s: the model-compile case stays fast",
    "test_patches.py::test_blocks_compiled_each_alone_share_their_graphs[mlp-True]": "4 CPU s: [full-True] stays fast",
    "test_patches.py::test_blocks_compiled_each_alone_share_their_graphs[attention-True]": "4 CPU s: as above",
    "test_attn_saved.py::test_attn_saved_matches_the_untouched_model":
        "15 cases of ~2 CPU s: one case per model stays fast (KEEP_FAST), every spec among them",
    "test_tiled.py::test_tiled_matches_the_untouched_model[qwen3-attn-saved+tiled]":
        "~2 CPU s: llama's attn-saved tiled cases stay fast",
    "test_tiled.py::test_tiled_matches_the_untouched_model[gpt2-attn-saved+tiled]":
        "~2 CPU s: llama's attn-saved tiled cases stay fast",
    "test_tiled.py::test_tiled_matches_the_untouched_model[gemma2-attn-saved+tiled]":
        "~2 CPU s: llama's attn-saved tiled cases stay fast",
    "test_tiled.py::test_tiled_matches_the_untouched_model[mixtral-attn-saved+tiled]":
        "~2 CPU s: llama's attn-saved tiled cases stay fast",
    "test_tiled.py::test_tiled_matches_the_untouched_model[qwen3-attn-saved+offload+tiled]": "as above",
    "test_tiled.py::test_tiled_matches_the_untouched_model[gpt2-attn-saved+offload+tiled]": "as above",
    "test_tiled.py::test_tiled_matches_the_untouched_model[gemma2-attn-saved+offload+tiled]": "as above",
}
KEEP_FAST = {
    "test_attn_saved.py::test_attn_saved_matches_the_untouched_model[llama-attn-saved]",
    "test_attn_saved.py::test_attn_saved_matches_the_untouched_model[qwen3-attn-saved+offload]",
    "test_attn_saved.py::test_attn_saved_matches_the_untouched_model[gpt2-every:2:attn-saved]",
    "test_attn_saved.py::test_attn_saved_matches_the_untouched_model[gemma2-attn-saved]",
    "test_attn_saved.py::test_attn_saved_matches_the_untouched_model[mixtral-attn-saved+offload]",
    "test_zoo.py::test_plans_on_fake_tensors[llama]",
    "test_mask_skip.py::test_families_compile_with_eagers_loss_and_gradients[llama-cache-default]",
    "test_mask_skip.py::test_families_compile_with_eagers_loss_and_gradients[llama-cache-off]",
}


@pytest.fixture
def fresh_caches():
    """remat's process caches (:mod:`remat.caches`) empty for the test, as in a new process, and
    emptied again after it (whatever the test put in them goes). Yields the module."""
    from remat import caches
    caches.clear()
    yield caches
    caches.clear()


def _check_entries():
    """A renamed test must not leave the list pointing at nothing (and the heavy test fast)."""
    here = os.path.dirname(__file__)
    for entry in list(SLOW) + sorted(KEEP_FAST):
        file, _, test = entry.partition("::")
        path = os.path.join(here, file)
        name = test.split("[")[0]
        if not os.path.exists(path) or not re.search(rf"^def {name}\(", open(path).read(), re.M):
            raise pytest.UsageError(f"tests/conftest.py: {entry} names no test; update SLOW or KEEP_FAST")


def pytest_configure(config):
    import torch
    if os.environ["OMP_NUM_THREADS"].isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # where a plugin imported torch before this file


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):
    _check_entries()
    slow = pytest.mark.slow
    for item in items:
        file, _, test = item.nodeid.partition("::")
        key = f"{os.path.basename(file)}::{test}"
        if key not in KEEP_FAST and (key in SLOW or key.split("[")[0] in SLOW):
            item.add_marker(slow)

    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

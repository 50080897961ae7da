"""Settings for the whole test suite (pytest loads this file for every test path below it).

The suite is written for CPU and gloo: its tolerances, process counts (2 to 8 local ranks)
and timings assume them. On a machine with a GPU, device detection would pick CUDA, so rank
1 of a 2-process test on a one-GPU host would ask for a second device, and the assertions
tuned for CPU would run on CUDA. Pin the device to CPU unless the caller chose one
(``TITAN_DEVICE=cuda pytest ...``); the GPU paths have their own script (tools/gpu_smoke.sh).
Subprocesses (torchrun workers, the real commands) inherit it.
"""

import os

import pytest

os.environ.setdefault("TITAN_DEVICE", "cpu")

TRAIN = "packages/titan-train/tests/"
MODELS = "packages/titan-models/tests/"
CKPT = "packages/titan-ckpt/tests/"
E2E = "integration_tests/"
BEFORE_RELEASE = "end to end; `hatch run test-full` runs it before every release"

# Proofs CI leaves to `hatch run test-full` so that `.ci/run` stays under 20 minutes on a
# 2-core machine: test id -> the test CI keeps for the same promise (at another level), or
# why it runs only before a release. A key names one test, every parametrization of it
# (`file::test`), or, ending in `*`, every id it starts. These are the slowest proofs (10 to
# 70 s each, together about half the suite's time); the suite's shorter `full` tests carry
# the marker beside them. An id that stops matching (a renamed test) runs in CI again.
FULL_IN_CI_ELSEWHERE = {
    # Fault tolerance through the real command: torchft replica groups.
    f"{TRAIN}test_fault_tolerance.py::test_both_replica_groups_finish_and_checkpoint_once":
        "test_semi_sync.py::test_a_group_that_joins_late_heals_at_the_next_sync (the trainer "
        "under a real lighthouse); titan-ckpt's and titan-optim's test_ft.py",
    f"{TRAIN}test_fault_tolerance.py::test_replica_groups_step_with_the_same_averaged_gradients":
        "titan-optim's test_ft.py::test_gradients_are_averaged_once_per_step_before_clipping",
    f"{TRAIN}test_fault_tolerance.py::test_replica_groups_train_like_two_data_parallel_ranks":
        "titan-optim's test_ft.py (replica groups average like data parallel ranks)",
    f"{TRAIN}test_fault_tolerance.py::test_resumed_replica_groups_continue_bit_for_bit":
        "titan-ckpt's test_ft.py::test_each_group_keeps_its_own_dataloader_and_resumes_it",
    f"{TRAIN}test_fault_tolerance.py::test_a_new_replica_group_count_reshards_the_per_group_data_state":
        "titan-ckpt's test_ft.py::test_a_new_group_takes_the_other_groups_dataloader_state_*",
    f"{TRAIN}test_fault_tolerance.py::test_a_killed_replica_group_heals_from_its_live_peer_and_rejoins":
        "test_semi_sync.py::test_a_group_that_joins_late_heals_at_the_next_sync; titan-ckpt's "
        "test_ft.py::test_peer_recovery_carries_everything_but_the_dataloader",
    f"{TRAIN}test_fault_tolerance.py::test_replica_groups_nudge_expert_biases_by_the_same_total_counts":
        BEFORE_RELEASE,
    f"{TRAIN}test_semi_sync.py::test_local_sgd_groups_agree_right_after_each_sync":
        "test_semi_sync.py::test_a_group_that_joins_late_heals_at_the_next_sync",
    # Restarts and launching.
    f"{E2E}test_restarts.py::test_a_killed_worker_restarts_from_the_newest_commit_with_the_same_losses":
        "titan-ckpt's test_commit_kill.py (a killed writer leaves older steps loadable); "
        "test_restarts.py::test_sigterm_saves_the_agreed_step_exits_143_and_resumes_*",
    f"{TRAIN}test_launch.py::test_a_launched_rank_exits_with_its_status_and_everything_it_printed":
        "every multi-rank titan-train run in CI goes through the launcher",
    # torchtitan users moving over: training runs of their configurations.
    f"{TRAIN}torchtitan/test_torchtitan_head.py::test_llama3_debugmodel_trains":
        "test_torchtitan_head.py::test_each_entry_loads_and_preflights; the main job trains",
    f"{TRAIN}torchtitan/test_torchtitan_checkout.py::test_debug_toml_trains_unedited":
        "the other test_torchtitan_checkout.py tests (tokenizer, c4_test, dataset folders)",
    f"{TRAIN}torchtitan/test_resume_from_torchtitan.py::test_two_fsdp_ranks_resume_torchtitans_single_process_checkpoint":
        "test_resume_from_torchtitan.py::test_titan_continues_torchtitans_run (one process); "
        "integration test_train_runs.py [fsdp] resumes across layouts",
    # Layouts through the real command (each one's model-level proof is CI's).
    f"{E2E}test_train_runs.py::test_two_rank_checkpoint_resumes_on_one_rank[pp]":
        "titan-ckpt's test_hf_sharded.py::test_pipeline_stages_export_every_parameter_*",
    f"{E2E}test_train_runs.py::test_pipeline_parallel_matches_one_process":
        "test_train_runs.py: pp_fsdp's validation losses equal one process's; titan-models' "
        "llama3/test_parallelize.py pp layouts",
    f"{E2E}test_train_runs.py::test_validation_loss_at_steps_10_and_20_equal_across_layouts[pp]":
        "the same test's [pp_fsdp]",
    f"{E2E}test_train_runs.py::test_tokens_per_second_is_per_device[pp]":
        "the same test's [pp_fsdp]",
    f"{E2E}test_matrix.py::test_row[pp_interleaved_1f1b]":
        "titan-models' llama3/test_parallelize.py [pp_interleaved_1f1b]",
    f"{E2E}test_matrix.py::test_sft_chat_qwen3_end_to_end":
        "test_sft.py (the example trains); test_generate_chat.py; integration test_generate.py",
    f"{E2E}test_deepseek_v3.py::test_expert_parallel_run_logs_the_load_of_each_moe_layer":
        "titan-models' moe/test_expert_parallel.py [2ranks]",
    f"{E2E}test_deepseek_v3.py::test_resume_at_another_expert_parallel_degree_continues_the_run":
        "titan-models' moe/test_expert_parallel.py::test_checkpoint_reshards_across_ep_degrees",
    f"{E2E}test_deepseek_v3.py::test_convert_to_hf_and_back_keeps_every_weight":
        "titan-models' deepseek_v3/test_adapter.py",
    f"{E2E}test_qwen3.py::test_a_tied_model_resumes_across_the_pipeline_split":
        "titan-models' qwen3/test_parallelize.py [pp_tied]; titan-ckpt's test_hf_sharded.py",
    f"{E2E}test_pipeline_init.py::test_no_two_blocks_of_a_three_stage_pipeline_start_alike":
        "test_init_layouts.py::test_two_rank_layouts_start_from_the_one_process_weights",
    f"{E2E}test_hf_export.py::test_titan_train_last_save_in_hf_with_another_vocabulary_and_plain_rope":
        "the other test_hf_export.py tests (vocabulary, plain RoPE)",
    f"{TRAIN}test_document_masking.py::test_a_run_with_document_masking_trains":
        "titan-models' documents/test_documents.py (2-rank masking equals one process)",
    f"{TRAIN}test_init_layouts.py::test_four_rank_mixes_start_from_the_one_process_weights":
        "test_init_layouts.py::test_two_rank_layouts_start_from_the_one_process_weights",
    f"{TRAIN}test_loss_normalization.py::test_two_gloo_ranks_equal_one_process":
        "integration test_train_runs.py::test_fsdp_on_two_ranks_matches_one_process",
    f"{TRAIN}data/test_shards.py::test_four_gloo_ranks_save_and_two_resume_through_titan_ckpt":
        "test_shards.py::test_resume_at_another_dp_continues_exactly; "
        "test_state_survives_a_distributed_checkpoint_merge",
    f"{TRAIN}test_generate.py::test_tensor_parallel_on_two_ranks_gives_the_single_process_tokens":
        "titan-models' llama3/test_parallelize.py [tp]; test_generate.py's one-process tests",
    f"{TRAIN}test_host_memory.py::test_a_reused_block_is_not_faulted_in_again": BEFORE_RELEASE,
    # Model layouts: Llama 3 (dense) and DeepSeek-V3 (MoE) run every 4-rank mix in CI; Qwen3's
    # 4-rank mixes are the same mixes with tied embeddings, whose 2-rank layouts are CI's.
    f"{MODELS}qwen3/test_parallelize.py::test_four_rank_layout_matches_single_process":
        "llama3's and deepseek_v3's test_four_rank_layout_matches_single_process; qwen3's "
        "2-rank [*_tied] layouts",
    f"{MODELS}llama3/test_parallelize.py::test_compile_compiles_each_block_and_matches_eager":
        "titan-train's test_compiled_loss.py::test_inductor_compiled_loss_equals_the_eager_loss",
    f"{MODELS}moe/test_expert_parallel.py::test_expert_parallel_equals_one_process[4ranks*":
        "the same tests' [2ranks]",
    f"{MODELS}moe/test_expert_parallel.py::test_expert_parallel_with_fsdp_equals_one_process[4ranks*":
        "the same tests' [2ranks]",
    f"{MODELS}moe/test_expert_parallel.py::test_checkpoint_reshards_across_ep_degrees[4ranks*":
        "the same tests' [2ranks]",
    f"{MODELS}moe/test_expert_parallel.py::test_built_on_meta_sharded_then_initialized[4ranks*":
        "the same tests' [2ranks]",
    f"{MODELS}moe/test_expert_parallel.py::test_uneven_experts_and_dense_models_are_refused[4ranks*":
        "the same tests' [2ranks]",
    f"{MODELS}moe/test_expert_parallel.py::test_one_host_read_per_forward[4ranks*":
        "the same tests' [2ranks]",
    # Checkpoints.
    f"{CKPT}test_distributed.py::test_fsdp2_round_trips_crash_and_reshard_4_2_1":
        "test_commit_kill.py (a killed writer); integration test_train_runs.py [fsdp] (2 -> 1 "
        "ranks through titan-train)",
    f"{CKPT}test_convert_memory.py": "test_convert.py (the same conversions, without "
        "measuring peak memory)",
    f"{CKPT}test_fuzz_readers.py": "test_untrusted_checkpoint.py and test_integrity.py (each "
        "damage the fuzzer draws from, made by hand)",
    # Optimizers and meshes at more ranks than CI's 2-rank runs of the same code.
    "packages/titan-optim/tests/test_muon.py::test_sharded_muon_equals_torch_muon_on_one_process[fsdp_tp4-4]":
        "the same test's [tp2-2] and [fsdp2-2]",
    "packages/titan-optim/tests/test_muon.py::test_sharded_muon_equals_torch_muon_on_one_process[hsdp4-4]":
        "the same test's [tp2-2] and [fsdp2-2]",
    "packages/titan-dims/tests/test_gloo.py::test_named_groups_and_all_reduce_on_gloo[8]":
        "the same test's [4]",
    "packages/titan-dims/tests/test_readme.py::test_readme_fsdp_example_matches_across_world_sizes":
        BEFORE_RELEASE,
}  # fmt: skip


def _leaves_ci(nodeid: str) -> bool:
    for key in FULL_IN_CI_ELSEWHERE:
        if key.endswith("*"):
            if nodeid.startswith(key[:-1]):
                return True
        elif nodeid == key or nodeid.startswith((key + "[", key + "::")):
            return True
    return False


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Mark ``full`` the tests of ``FULL_IN_CI_ELSEWHERE``; mark ``slow`` every test that
    launches ranks through a ``run_torchrun`` fixture (directly or through the fixtures it
    uses): the `alone` environments leave them out."""
    for item in items:
        if _leaves_ci(item.nodeid):
            item.add_marker(pytest.mark.full)
        if "run_torchrun" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)

"""The NCCL flight recorder (issue 18, F20): torchtitan's comm.trace_buf_size,
save_traces_folder and save_traces_file_prefix set torch's variables before the process
group starts, so a timed-out collective leaves a dump per rank under the run's folder;
nothing on CPU; a user's own setting wins; the keys load from a torchtitan TOML."""

from __future__ import annotations

import os

from titan_train import JobConfig, parse_job_config
from titan_train.trainer.loop import flight_recorder_env


def test_the_flight_recorder_is_set_up_on_accelerators(tmp_path, monkeypatch):
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    config = JobConfig()
    config.job.dump_folder = str(tmp_path)
    assert flight_recorder_env(config, "cpu") == {}
    assert flight_recorder_env(config, "cuda") == {
        "TORCH_FR_BUFFER_SIZE": "20000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": os.path.join(str(tmp_path), "comm_traces", "rank_"),
    }
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "500")
    assert "TORCH_FR_BUFFER_SIZE" not in flight_recorder_env(config, "cuda")
    config.comm.trace_buf_size = 0
    assert flight_recorder_env(config, "cuda") == {}


def test_torchtitans_comm_keys_load(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        '[comm]\ntrace_buf_size = 123\nsave_traces_folder = "fr"\nsave_traces_file_prefix = "r"\n'
    )
    config = parse_job_config(["--job.config_file", str(toml)])
    comm = config.comm
    assert (comm.trace_buf_size, comm.save_traces_folder, comm.save_traces_file_prefix) == (
        123,
        "fr",
        "r",
    )

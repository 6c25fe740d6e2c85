"""The exit codes of `rloo-engine train`, one per kind of end, so a launcher (the pipeline's train stage, a
Slurm script) can tell them apart without reading the log. Each failure also prints one `error:` line.

| code | meaning | retry? |
|---|---|---|
| 0 | trained | - |
| 2 | a configuration error (a field, a path, a reward source that never scores) | no: fix the config |
| 3 | an injected crash (`RLOO_ENGINE_CRASH_AT_STEP`, the reliability tests) | resumes |
| 4 | a reward source raised or returned something unusable during training | once the source is fixed |
| 5 | an output could not be written: a checkpoint write failed or was refused by the free-space check, or the disk is full | once there is room |
| 6 | the vLLM server (`vllm_mode: server`) is down, died, hung past `vllm_server_timeout` or refused a request | resumes once it is back |
"""

OK = 0
CONFIG_ERROR = 2
INJECTED_CRASH = 3
REWARD_ERROR = 4
DISK_ERROR = 5
GENERATOR_ERROR = 6

MEANINGS = {
    OK: "trained",
    CONFIG_ERROR: "a configuration error",
    INJECTED_CRASH: "an injected crash (RLOO_ENGINE_CRASH_AT_STEP)",
    REWARD_ERROR: "a reward source failed during training",
    DISK_ERROR: "an output could not be written (disk full or an I/O error)",
    GENERATOR_ERROR: "the vLLM server failed or did not answer within vllm_server_timeout",
}

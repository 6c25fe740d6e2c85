"""Everything that guards one run's output_dir: checks before anything loads (`preflight`), the lock
(`lock`), which run a directory holds and whether this one may continue it (`continuity`), one filesystem across
nodes (`shared_output_dir`), checkpoints and exact resume (`checkpoint`), and the test-only fault hooks
(`fault_injection`). `claim_output_dir` (`claim`) runs them in the order a run needs."""

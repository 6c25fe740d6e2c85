"""`python -m rloo_engine ...` is the same as the `rloo-engine` console script (used by `accelerate launch -m`)."""

from rloo_engine.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

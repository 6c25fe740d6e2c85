"""Test helpers shipped with the package (as `prefect.testing` is): tiny offline models and tokenizers, and fake
OpenAI chat/Batch servers. The tests, the benches, the demo and `rloo-engine tiny-assets` use them; the engine's
own modules never do (tests/test_layering.py)."""

"""`python -m rloo_engine.vllm_server_entry <vLLM server flags>`: vLLM's OpenAI server with `rloo_gloo` registered.

The `vllm.general_plugins` entry point registers it in every vLLM process of an installed rloo-pipeline; this
also covers a checkout on PYTHONPATH, where no entry point exists (the engine core then runs in this process:
`VLLM_ENABLE_V1_MULTIPROCESSING=0`).
"""

import runpy

from rloo_engine.vllm_gloo_transfer import register

if __name__ == "__main__":
    register()
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)

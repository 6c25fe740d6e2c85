"""MLflow "models from code" definition of a registered policy. MLflow executes this file; do not import it.

A registered version is a pyfunc model whose `checkpoint` artifact is the policy's HF checkpoint
(`save_pretrained` format). It needs only torch and transformers to load, works offline, and the
checkpoint itself can be fetched for training or evaluation with
`mlflow.artifacts.download_artifacts("models:/<name>@<alias>")` (it is under `artifacts/checkpoint/`).

    model = mlflow.pyfunc.load_model("models:/rloo-policy@candidate")
    model.predict(["TL;DR: ..."], params={"max_new_tokens": 64})  # -> list of completions
"""

from __future__ import annotations

from typing import Any

import mlflow
from mlflow.pyfunc import PythonModel


class CausalLMPolicy(PythonModel):
    """Greedy (or sampled, via params) completions of a list of prompts, from the packaged checkpoint."""

    # The signature (with its params schema) is given explicitly when the model is saved, so MLflow's
    # type-hint validation wrapper (and its "add type hints" warning at every save) is not wanted.
    _skip_type_hint_validation = True

    def load_context(self, context: Any) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = context.artifacts["checkpoint"]
        self.tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(path).eval()

    def predict(self, context, model_input, params=None):
        import torch

        params = params or {}
        if hasattr(model_input, "columns"):  # DataFrame: the first column holds the prompts
            model_input = model_input.iloc[:, 0]
        prompts = [str(p) for p in model_input]
        enc = self.tokenizer(prompts, return_tensors="pt", padding=True)
        with torch.inference_mode():
            out = self.model.generate(
                **enc,
                max_new_tokens=int(params.get("max_new_tokens", 128)),
                do_sample=bool(params.get("do_sample", False)),
                pad_token_id=self.tokenizer.pad_token_id,
            )
        return self.tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)


mlflow.models.set_model(CausalLMPolicy())

"""Reward models: a name in `rewards.names` that is a hub id (it has a '/') or a local folder is a reward model,
scored as TRL 1.15 scores one given by name (`RewardModel`). Its own module because scoring one loads
transformers and torch (and `trl.data_utils`' chat template): those imports sit inside `RewardModel`'s methods,
run only when a run names a reward model, so rewards.py, which imports this module, stays pure at import
(tests/test_imports.py guards both).

    is_reward_model("OpenAssistant/reward-model-deberta-v3-large-v2")   # True: a hub id
    load_reward_models(config.rewards, resolved.reward_model_device)   # a run loads them once, before writing
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from lowvram_grpo.core.errors import ConfigError, RewardError
from lowvram_grpo.task.user_files import first_line


def is_reward_model(name: str) -> bool:
    """A name in rewards.names that is a reward model (a hub id has a '/', a local folder exists), as TRL
    takes a string: not a function's name."""
    return "/" in name or Path(name).expanduser().is_dir()


def model_id_name(name: str) -> str:
    """The name TRL logs a reward model under (`rewards/<name>/mean`): its model id's last path part."""
    return name.rstrip("/").rsplit("/", 1)[-1]


class RewardModel:
    """A reward model given by name (hub id or local folder), scored the way TRL 1.15 scores one
    (GRPOTrainer: `AutoModelForSequenceClassification.from_pretrained(name, num_labels=1)` with its own
    tokenizer, pad token = eos when it has none; prompt + completion through the chat template when
    conversational, else concatenated; right padding, no special tokens added; the first logit). Loaded
    once per process (`load(device)`, before anything is written), shared by training and evaluation. The
    device is resolve()'s (`Resolved.reward_model_device`); only a caller outside a run that names none
    (a notebook scoring by hand) gets torch's guess."""

    _loaded: dict[str, tuple] = {}

    def __init__(self, name: str, chat_template_kwargs: Optional[dict] = None):
        self.name = name
        self.__name__ = model_id_name(name)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})  # data.chat_template_kwargs, as TRL passes its own

    def load(self, device: Optional[str] = None) -> tuple:
        if self.name not in self._loaded:
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            try:
                model = AutoModelForSequenceClassification.from_pretrained(self.name, num_labels=1)
                tokenizer = AutoTokenizer.from_pretrained(self.name)
            except Exception as exc:
                raise RewardError(f"reward model {self.name!r} in rewards.names cannot be loaded ({first_line(exc)}): "
                                  "give a sequence-classification model's hub id or folder") from None
            if tokenizer.pad_token_id is None:
                tokenizer.pad_token = tokenizer.eos_token
            model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
            import torch

            if device is None:  # outside a run (no Resolved): where torch finds a card
                device = "cuda" if torch.cuda.is_available() else "cpu"
            model.to(device).eval()
            self._loaded[self.name] = (model, tokenizer)
        return self._loaded[self.name]

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        import torch
        from trl.data_utils import apply_chat_template, is_conversational

        model, tokenizer = self.load()
        if is_conversational({"prompt": prompts[0]}):
            texts = [apply_chat_template({"messages": p + c}, tokenizer, **self.chat_template_kwargs)["text"]
                     for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        inputs = tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right",
                           add_special_tokens=False)
        with torch.inference_mode():
            return model(**inputs.to(model.device)).logits[:, 0].tolist()


def load_reward_models(rewards_config, device: Optional[str] = None) -> None:
    """Load the reward models named in rewards.names (after the policy model, before anything is written) on
    `device`: the run's `Resolved.reward_model_device`."""
    for name in rewards_config.names:
        if is_reward_model(name):
            try:
                RewardModel(name).load(device)
            except RewardError as exc:
                raise ConfigError(str(exc)) from None

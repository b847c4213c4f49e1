"""Stand-ins for what a recipe needs the user to make first, holding what its config checks read."""

import json
from pathlib import Path

from rlkit.launch.config import compose_recipe
from rlkit.models.tiny import build_tokenizer


def reward_model_overrides(recipe: str, root: Path) -> list[str]:
    """Recipes scored by a reward model the user trains first (env.parts.preference): a stand-in
    sequence classifier in root (its config.json and tokenizer), as the override that points there."""
    if "preference" not in compose_recipe(recipe, []).get("env", {}).get("parts", {}):
        return []
    path = root / "reward_model"
    build_tokenizer().save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": [
        "Qwen2ForSequenceClassification"], "id2label": {"0": "LABEL_0"}}))
    return [f"env.parts.preference.model_path={path}"]

"""Turn policy.model_path into an HF checkpoint directory (building tiny:// models, cached)."""

import hashlib
import json
import logging
from pathlib import Path

from rlkit.config.schema import RootConfig
from rlkit.models.tiny import build_tiny_model, parse_tiny

log = logging.getLogger("rlkit")


def cache_key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def resolve_model_dir(cfg: RootConfig) -> Path:
    arch = parse_tiny(cfg.policy.model_path)
    if arch is None:
        return Path(cfg.policy.model_path)
    t = cfg.policy.tiny_model
    out = Path(cfg.run.cache_dir) / f"tiny-{arch}-{cache_key(arch, t.hidden_size, t.num_layers, t.seed)}"
    if not (out / "config.json").is_file():
        log.info("building tiny %s model (hidden %d, %d layers) in %s", arch, t.hidden_size, t.num_layers, out)
        build_tiny_model(arch, out, t.hidden_size, t.num_layers, t.seed)
    return out.resolve()

"""What a simulated run takes the place of absent model folders and data with.

The simulator reads a model's dimensions (config.json: KV bytes per token) and tokenizes the
project's arithmetic task; it never loads weights. For a model whose folder is absent, a
stand-in folder holds the model card's config.json (`assets/cards.py`, matched by the folder's
name) and the project's own tokenizer (the task's text is the project's on every run, live or
simulated); absent data files become the project's synthetic dataset. Each substitution is
logged and listed in the run's summary, so a reader knows what was simulated from what.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from pivotrl_hpc.config.errors import ConfigError
from pivotrl_hpc.config.schema import Config

log = logging.getLogger(__name__)


def stand_in(cfg: Config, workdir: Path) -> tuple[Config, list[str]]:
    """`cfg` with absent model folders and data replaced under `workdir`; the notes."""
    notes: list[str] = []
    models = {}
    for name in ("policy", "genrm"):
        m = getattr(cfg.models, name)
        path, note = _model_folder(name, m.path, workdir)
        models[name] = dataclasses.replace(m, path=path)
        if note:
            notes.append(note)
    data = cfg.data
    if data.format == "synthetic":
        pass
    elif not (data.train and Path(data.train).is_file()):
        notes.append(f"data.train {data.train or '(none)'} absent: the synthetic arithmetic "
                     "dataset")
        data = dataclasses.replace(data, format="synthetic", train="", validation="")
    elif data.validation and not Path(data.validation).is_file():
        notes.append(f"data.validation {data.validation} absent: no validation")
        data = dataclasses.replace(data, validation="")
    for note in notes:
        log.info("simulate: %s", note)
    out = dataclasses.replace(cfg, data=data, models=dataclasses.replace(cfg.models, **models))
    return out, notes


def _model_folder(name: str, path: str, workdir: Path) -> tuple[str, str | None]:
    if path and (Path(path) / "config.json").is_file():
        return path, None
    from pivotrl_hpc.assets.cards import CARDS, card_for
    found = card_for(path) if path else None
    if found is None:
        raise ConfigError(f"models.{name}.path",
                          f"{path or '(empty)'} is absent and names no model card "
                          f"({', '.join(CARDS)}); the simulator needs at least the model's "
                          "config.json (no weights)")
    card, config = found
    folder = workdir / f"{name}-{card}"
    if not (folder / "config.json").is_file():   # once per scratch folder, not once per run
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        _tokenizer(folder)
        (folder / "config.json").write_text(json.dumps(config))
    return str(folder), f"models.{name}.path {path} absent: the {card} model card"


def _tokenizer(folder: Path) -> None:
    from pivotrl_hpc.assets.tokenizer import build_tokenizer
    build_tokenizer().save_pretrained(folder)

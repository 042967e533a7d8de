"""Publishing a saved arbiter to the Hugging Face Hub.

The folder written by :meth:`ArbiterModel.save_pretrained` is uploaded as is, with a model
card whose metadata lets the Hub link the adapter to its base model (``base_model``,
``library_name: peft``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, ModelCardData
from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from huggingface_hub.utils import validate_repo_id

from cospec.arbiter.model import ADAPTER_FILE, HEAD_FILE, ArbiterConfig
from cospec.errors import CoSpecError
from cospec.toy.world import TOY_PREFIX

TAGS = ["cospec", "speculative-decoding", "arbiter", "lora", "peft"]


def push_to_hub(
    arbiter_dir: str | Path,
    repo_id: str,
    *,
    api: HfApi | None = None,
    private: bool = True,
    training_summary: Mapping[str, Any] | None = None,
    commit_message: str = "Upload CoSpec arbiter",
) -> str:
    """Create ``repo_id`` (if needed), write README.md into ``arbiter_dir``, upload the folder.

    Private by default: an arbiter is usually published for a team before it is public.
    Returns the repository URL. ``api`` defaults to ``HfApi()`` (token from the usual
    places); Hub and network failures become a one-line :class:`CoSpecError`.
    """
    directory = Path(arbiter_dir)
    config = ArbiterConfig.load(directory)
    for name in (HEAD_FILE, ADAPTER_FILE):
        if not (directory / name).is_file():
            raise CoSpecError(f"arbiter directory {str(directory)!r} is incomplete: no {name}")
    (directory / "README.md").write_text(model_card(config, repo_id, training_summary))
    api = HfApi() if api is None else api
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(
            repo_id=repo_id,
            folder_path=directory,
            repo_type="model",
            commit_message=commit_message,
        )
    except (HfHubHTTPError, OSError, ValueError) as err:
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise CoSpecError(f"cannot push arbiter to {repo_id!r}: {first_line}") from err
    return str(url)


def model_card(
    config: ArbiterConfig, repo_id: str, training_summary: Mapping[str, Any] | None = None
) -> str:
    """README.md text: YAML metadata, how to load, the arbiter's shape and training summary.

    ``base_model`` goes into the metadata only when it is a Hub id: the Hub rejects
    metadata that names a local path or a toy model.
    """
    on_hub = _is_hub_id(config.base_model)
    metadata = ModelCardData(
        base_model=config.base_model if on_hub else None, library_name="peft", tags=TAGS
    )
    base = (
        f"[{config.base_model}](https://huggingface.co/{config.base_model})"
        if on_hub
        else (f"`{config.base_model}` (not on the Hub)")
    )
    lines = [
        "---",
        metadata.to_yaml(),
        "---",
        "",
        f"# {repo_id.split('/')[-1]}",
        "",
        "A CoSpec arbiter: a LoRA adapter on the drafter's base model plus a scalar head.",
        "At a position where the drafter's and the target's tokens disagree, it gives the",
        "probability of keeping the draft token (collaborative speculative decoding).",
        "",
        f"- Base model (the drafter): {base}",
        f"- Block length K (`num_draft_tokens`): {config.num_draft_tokens}",
        f"- Head layout: {config.head_layout}",
        f"- LoRA: r={config.lora_r}, alpha={config.lora_alpha}, dropout={config.lora_dropout}, "
        f"target modules {config.lora_target_modules}",
        "",
        "## Usage",
        "",
        "```python",
        "from huggingface_hub import snapshot_download",
        "from cospec.arbiter import ArbiterModel",
        "",
        f'arbiter = ArbiterModel.load(snapshot_download("{repo_id}"))',
        "```",
    ]
    if training_summary:
        lines += ["", "## Training summary", "", "| | |", "|---|---|"]
        lines += [f"| {key} | {value} |" for key, value in training_summary.items()]
    return "\n".join(lines) + "\n"


def _is_hub_id(name: str) -> bool:
    if not name or name.startswith(TOY_PREFIX) or Path(name).expanduser().exists():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True

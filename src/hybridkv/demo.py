"""The built-in demo checkpoints and the demo's prompts: where the checkpoints are, the
names commands accept for them, and the batch `hybridkv demo` serves (a shared Python
header and eight tails). Paths and strings only: this module imports nothing of
hybridkv, and inside the package only the CLI imports it (the demo command is
`hybridkv.cli.demo`).
"""

from __future__ import annotations

from pathlib import Path

DEMO_MODELS = Path(__file__).resolve().parent / "engine" / "models" / "demo_models"
DEMO_MAIN = DEMO_MODELS / "main"
DEMO_DRAFT = DEMO_MODELS / "draft"
DEMO_MTP = DEMO_MODELS / "mtp"  # an MTP head for the main (scripts/train_demo_mtp.py)
DEMO_MEMORY_BYTES = 32 << 20
DEMO_MAX_MODEL_LEN = 1024

HEADER = (
    '"""Command line tool: read files, count lines, print a report."""\n'
    "import os\nimport sys\nimport json\nimport argparse\n"
    "from collections import defaultdict\n\n"
    "def read_lines(path):\n    with open(path) as f:\n        return f.readlines()\n\n"
)
TAILS = (
    "def main(",
    "def parse_args(",
    "class Config:\n    def __init__(self, ",
    "def count_words(text):\n    ",
    "def walk(root):\n    for dirpath, dirnames, filenames in os.walk(",
    "def load_json(path):\n    with open(path) as f:\n        ",
    "if __name__ == '__main__':\n    ",
    "def report(counts):\n    for name, count in sorted(",
)


def demo_prompts(num_requests: int) -> list[str]:
    """``num_requests`` prompts: the shared header + one of eight tails (cycled)."""
    return [HEADER + TAILS[i % len(TAILS)] for i in range(num_requests)]


# Names of the built-in checkpoints. Each folder holds config.json, model.safetensors and
# Hugging Face tokenizer files: point a client's tokenizer at it, e.g.
# AutoTokenizer.from_pretrained(hybridkv.demo.DEMO_MAIN).
DEMO_CHECKPOINTS = {
    "demo": DEMO_MAIN,
    "demo-main": DEMO_MAIN,
    "demo-draft": DEMO_DRAFT,
    "demo-mtp": DEMO_MTP,
}


def resolve_model(name: str) -> Path:
    """``demo`` / ``demo-main`` / ``demo-draft`` / ``demo-mtp`` (the MTP head) name the
    built-in models; else a path."""
    return DEMO_CHECKPOINTS.get(name, Path(name))

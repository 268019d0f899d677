"""Draw the README's plan picture: the bundled Qwen3.8-27B-FP8-shaped checkpoint on a
24 GiB card beside vLLM's cpu_offload_gb=10, the same plan as `bash scripts/demo.sh`
prints (reference link and VRAM bandwidths, no host-memory check).

    python scripts/make_plan_picture.py [OUT_DIR]   # default: docs/images

Writes plan-picture-qwen3.8-27b-fp8.png and, beside it, .json: what the picture shows
(picture.picture_data), which tests/unit/test_picture.py recomputes and compares, so the
picture in the README cannot silently drift from the plan it claims to show.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from selective_offload.checkpoint import load_checkpoint  # noqa: E402
from selective_offload.cli import BUNDLED  # noqa: E402
from selective_offload.picture import draw, picture_data  # noqa: E402
from selective_offload.plan_format import PlanInputs  # noqa: E402
from selective_offload.planner import make_plan  # noqa: E402
from selective_offload.sizes import GiB  # noqa: E402

NAME = "plan-picture-qwen3.8-27b-fp8"


def reference_plan():
    return make_plan(load_checkpoint(BUNDLED["qwen3.8-27b-fp8"]),
                     PlanInputs(device_memory_bytes=24 * GiB, vllm_cpu_offload_gb=10.0))


def main(out_dir: Path) -> list[Path]:
    data = picture_data(reference_plan())
    png, meta = out_dir / f"{NAME}.png", out_dir / f"{NAME}.json"
    draw(data, [png])
    meta.write_text(json.dumps(data, indent=1) + "\n")
    return [png, meta]


if __name__ == "__main__":
    for path in main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "images"):
        print(f"wrote {path}")

"""The README's statements about fused-MoE kernels and cards are the kernel table's, generated.

The block between the README's kernel-table markers is ``kernels.readme_block()``; to
refresh it after the table changes::

    .venv/bin/python -c "from pathlib import Path; from selective_offload.planner import kernels; \\
        p = Path('README.md'); p.write_text(kernels.readme_with_block(p.read_text()))"
"""

from __future__ import annotations

import re

from helpers import REPO
from selective_offload.planner import kernels

README = REPO / "README.md"


def test_the_readme_kernel_block_is_the_generated_one():
    text = README.read_text()
    assert text.count(kernels.README_BEGIN) == 1 and text.count(kernels.README_END) == 1
    assert kernels.readme_with_block(text) == text, "README's kernel table is stale: regenerate it (see this module)"


def test_no_typed_kernel_claim_outside_the_block():
    """Outside the generated block neither the README nor docs/ names a card's default kernel in prose (the
    statement this issue found false: "FlashInfer by default on most cards")."""
    text = README.read_text()
    start, end = text.index(kernels.README_BEGIN), text.index(kernels.README_END)
    outside = text[:start] + text[end:] + "".join(p.read_text() for p in sorted((REPO / "docs").rglob("*.md")))
    assert not re.search(r"(FlashInfer|Marlin|DeepGEMM)[^.\n]*\bby default\b|defaults to (FlashInfer|Marlin)",
                         outside)
    assert "| Marlin (MXFP4, NVFP4, WNA16) | refused |" not in outside


def test_the_block_says_what_the_table_says():
    block = kernels.readme_block()
    row = next(line for line in block.splitlines() if line.startswith("| mxfp4 |"))
    cells = [c.strip() for c in row.strip("|").split("|")][1:]
    for card, cell in zip(kernels.CARDS, cells):
        kernel = kernels.kernel_for("mxfp4", card)
        assert cell.startswith(kernels._short(kernel))
        assert ("(uva)" in cell) == kernels.reads_uva(kernel)
        fix = kernels.advice("mxfp4", card)
        assert (fix is not None and f"`{fix}`" in cell) == (not kernels.reads_uva(kernel))

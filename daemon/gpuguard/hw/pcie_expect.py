"""Config schema of the PCIe checks: `expect_link` of a GPU (`gpus: - match: {bdf: ...}
expect_link: {gen: 4, width: 16}`). The integrator wires `ExpectedLink` into the root
config; `gpuguard doctor --config` reads just this part (gpuguard.policy.doctor)."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

GENERATION_GTS = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}


class ExpectedLink(BaseModel):
    """What a GPU's slot link must train to; a mismatch is an alert-grade finding."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    gen: int | None = Field(default=None, ge=1, le=6, description="PCIe generation (4 = 16 GT/s)")
    width: int | None = Field(default=None, description="lanes: 1, 2, 4, 8, 16 or 32")

    def model_post_init(self, _ctx: Any) -> None:
        if self.width is not None and self.width not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"width {self.width}: must be 1, 2, 4, 8, 16 or 32")

    @property
    def speed_gts(self) -> float | None:
        return GENERATION_GTS[self.gen] if self.gen else None

"""A tenant's limits as one short text, shared by the console's tenants table and `sluice
tenants`; no Textual here."""

from __future__ import annotations

from sluice.ipc import messages as m

_SHORT = {"input_tokens_per_minute": "in/min", "output_tokens_per_minute": "out/min"}


def limits_text(tenant: m.TenantRow) -> str:
    """The limits a tenant has, each bucket with what it holds now: `out/min=6000(4200)`."""
    available = {"input_tokens_per_minute": tenant.input_tokens_available,
                 "output_tokens_per_minute": tenant.output_tokens_available}
    shown = []
    for name, value in vars(tenant.limits).items():
        if value is None:
            continue
        text = f"{_SHORT.get(name, name)}={value:g}"
        if available.get(name) is not None:
            text += f"({available[name]:.0f})"
        shown.append(text)
    return " ".join(shown) or "-"

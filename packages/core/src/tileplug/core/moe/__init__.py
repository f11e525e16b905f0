"""The MoE routing family's numeric authority in plain PyTorch (SPEC §7, docs/spec.md "MoE
routing"): scoring, selection with ties to the smaller index, group-limited routing, the
weights, their gradient and the expanded-row layout, used by the reference backend and by
the op table's test inputs. See :mod:`tileplug.core.moe.formulas`."""

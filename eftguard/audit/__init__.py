"""The audit: attacks run through one pipeline (`run_attack`) and scored by the auditor (`scoring`) into an
`AttackReport`. See docs/attacks.md."""

from eftguard.audit.api import attack_names, run_attack
from eftguard.attack_report import SCHEMA_VERSION, AttackReport, read_attack_report

__all__ = ["AttackReport", "SCHEMA_VERSION", "attack_names", "read_attack_report", "run_attack"]

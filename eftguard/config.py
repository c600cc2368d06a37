"""The training configuration: one dataclass, read from / written to TOML, validated once."""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

import tomli_w

from eftguard import schedule
from eftguard.canaries import CANARY_KINDS, canary_set
from eftguard.data.registry import check_dataset_name
from eftguard.errors import ConfigError
from eftguard.methods import METHODS as METHOD_SPECS, method_spec, methods_with
from eftguard.model import PRESETS, ModelError, check_local_layers
from eftguard.paths import input_file_problem
from eftguard.precision import PRECISIONS
from eftguard.sampling import BALANCE_MODES

METHODS = tuple(METHOD_SPECS)
ACCOUNTANTS = ("prv", "rdp")  # opacus accountants that calibrate DP-SGD noise
FEDERATIONS = ("simulation", "deployment")
HEAD_PRUNING = ("importance", "random")  # headprune-lora: which heads a client keeps
HEAD_WEIGHTING = ("importance", "samples")  # headprune-lora: each head's average weighted by alpha_c or by n_k
CLIENT_SELECTION = ("random", "loss-gap")
# malicious: the server tampers with one round's model; adaptive: every round it moves each client's model towards
# the tampering as far as the clients' model check allows (attacks/tamper.py)
THREATS = ("honest", "malicious", "adaptive")
TAMPERINGS = ("identity-embed", "stealth-embed", "label-probe")  # --tamper: eftguard.attacks.tamper implements each
SEED_LIMIT = 2 ** 32 - 1  # the largest --seed of training and of the attacks
DP_EPS_LIMIT = 100.0  # above it e^epsilon bounds nothing, and the accountants' noise search does not end
DP_ROUNDS_LIMIT = 10_000  # with --dp-eps, every client's rounds are listed and accounted for before round 1


@dataclass
class TrainConfig:
    """Every knob of a training run. Empty strings and zeros mean "not set" (TOML has no null)."""

    dataset: str = "photos"
    data_dir: str = ""
    model: str = "vit-tiny-32"
    pretrained: bool = False
    checkpoint: str = ""
    method: str = "eftvit"
    mask_ratio: float = 0.75
    prompt_tokens: int = 10  # fed-prompt's learned tokens
    lora_rank: int = 8  # fed-lora's rank r of the factors B (out x r) and A (r x in)
    head_sparsity: float = 0.9  # headprune-lora: fraction s of each layer's heads a client prunes (the paper's 0.9)
    head_pruning: str = "importance"
    head_weighting: str = "importance"
    client_selection: str = "random"  # loss-gap: after round 1, the clients whose local loss most exceeds the global's
    local_layers: int = 2
    clients: int = 8
    clients_per_round: int = 0  # 0: all clients
    rounds: int = 5
    local_epochs: int = 1
    server_epochs: int = 1  # 0: theta is never trained on the uploaded features (a baseline)
    batch_size: int = 64
    lr: float = 0.0  # 0: the method's default_lr (eftguard.methods)
    server_lr: float = 1e-3
    warmup_rounds: int = 0  # rounds of linear warm-up of --lr and --server-lr
    lr_schedule: str = "constant"  # after the warm-up: constant, or cosine decay toward 1% (eftguard.schedule)
    weight_decay: float = 0.05
    beta: float = 0.1
    balance: str = "median"
    seed: int = 0
    train_samples: int = 2000  # 0: the whole train split; the default keeps a CPU run under 3 minutes
    test_samples: int = 500  # 0: the whole test split
    federation: str = "simulation"
    cpus_per_client: float = 1.0
    record_truth: bool = True  # clients send auditor-only ground truth for truth/
    encrypt_at_rest: str = ""  # key file; "" stores uploads in plaintext
    round_timeout: float = 3600.0
    dp_eps: float = 0.0  # 0: no DP-SGD
    dp_delta: float = 0.0  # 0: 1 / (10 n_k) per client
    max_grad_norm: float = 1.0
    accountant: str = "prv"
    dp_feature_share: float = 0.5  # fraction of dp_eps for the feature channel (methods that upload features)
    feature_noise: float = 0.0
    feature_clip: float = 0.0  # 0: uploaded features are neither clipped nor noised
    canaries: int = 0  # 0: no canaries (eftguard attack dp-audit needs them)
    canary_kind: str = "mislabelled"
    threat: str = "honest"  # malicious: simulation only, to measure the tamperings and the client's model check
    tamper: str = ""  # the tampering of a malicious server (TAMPERINGS)
    tamper_round: int = 0  # the round the server tampers with (0: the last)
    model_check: bool = True  # simulated clients check the model they receive (eftguard.defenses.model_check)
    precision: str = "fp32"  # of the forward passes: fp32, or bf16 matrix products (eftguard.precision)

    def resolved(self) -> "TrainConfig":
        """A validated copy with defaults that depend on other fields filled in."""
        cfg = dataclasses.replace(self)
        if cfg.clients_per_round == 0:
            cfg.clients_per_round = cfg.clients
        cfg.lr = cfg.client_lr
        if cfg.threat == "malicious" and cfg.tamper_round == 0:
            cfg.tamper_round = cfg.rounds
        cfg.validate()
        return cfg

    def validate(self) -> None:
        self._check_finite()
        check_dataset_name(self.dataset)
        if self.model not in PRESETS:
            raise ConfigError(f"--model: unknown preset '{self.model}', choose {', '.join(PRESETS)}")
        method = method_spec(self.method)
        if not 0.0 <= self.mask_ratio < 1.0:
            raise ConfigError(f"--mask-ratio must be in [0, 1) (fraction of patches dropped), got {self.mask_ratio}")
        try:
            check_local_layers(self.local_layers, 12)
        except ModelError as exc:
            raise ConfigError(str(exc)) from None
        if self.balance not in BALANCE_MODES:
            raise ConfigError(f"--balance: unknown mode '{self.balance}', choose {', '.join(BALANCE_MODES)}")
        if self.federation not in FEDERATIONS:
            raise ConfigError(f"--federation: unknown runtime '{self.federation}', choose {', '.join(FEDERATIONS)}")
        if self.accountant not in ACCOUNTANTS:
            raise ConfigError(f"--accountant: unknown accountant '{self.accountant}', choose {', '.join(ACCOUNTANTS)}")
        self._check_head_pruning()
        self._check_precision()
        if not 0 <= self.dp_eps <= DP_EPS_LIMIT:
            raise ConfigError(f"--dp-eps must be in [0, {DP_EPS_LIMIT:g}] (0: no DP-SGD; above {DP_EPS_LIMIT:g} the "
                              f"guarantee e^epsilon bounds nothing), got {self.dp_eps}")
        if self.dp_eps > 0 and self.rounds > DP_ROUNDS_LIMIT:
            raise ConfigError(f"--rounds {self.rounds} with --dp-eps: each client's noise is calibrated for all its "
                              f"rounds before round 1, which does not end in reasonable time above {DP_ROUNDS_LIMIT} "
                              "rounds: lower --rounds")
        if not 0.0 <= self.dp_delta < 1.0:
            raise ConfigError(f"--dp-delta must be in [0, 1) (0: 1 / (10 n) per client), got {self.dp_delta}")
        if self.dp_eps > 0 and not method.dp_sgd:
            private = ", ".join(m.name for m in methods_with("dp_sgd"))
            reason = f": {method.no_dp_reason}" if method.no_dp_reason else ""
            raise ConfigError(f"--dp-eps: --method {method.name} has no DP-SGD{reason} (methods with DP-SGD: "
                              f"{private})")
        if self.dp_eps > 0 and method.uploads_features:
            if not 0 < self.dp_feature_share < 1:
                raise ConfigError(f"--dp-feature-share must be in (0, 1) (the feature channel's fraction of "
                                  f"--dp-eps), got {self.dp_feature_share}")
            if self.feature_noise > 0:
                raise ConfigError("--feature-noise: with --dp-eps the feature noise is calibrated to the budget; "
                                  "drop --feature-noise (--feature-clip sets the clipping norm)")
        if self.feature_noise < 0 or self.feature_clip < 0:
            raise ConfigError("--feature-noise and --feature-clip must be >= 0")
        if self.feature_noise > 0 and self.feature_clip == 0:
            raise ConfigError("--feature-noise is relative to the clipping norm: set --feature-clip C > 0 too")
        if self.feature_clip > 0 and not method.uploads_features:
            uploading = ", ".join(m.name for m in methods_with("uploads_features"))
            raise ConfigError(f"--feature-clip/--feature-noise apply to uploaded features; --method {method.name} "
                              f"uploads none (methods that do: {uploading})")
        positive = {"clients": self.clients, "rounds": self.rounds, "local_epochs": self.local_epochs,
                    "batch_size": self.batch_size, "lr": self.lr,
                    "server_lr": self.server_lr, "beta": self.beta, "cpus_per_client": self.cpus_per_client,
                    "round_timeout": self.round_timeout, "max_grad_norm": self.max_grad_norm,
                    "prompt_tokens": self.prompt_tokens, "lora_rank": self.lora_rank}
        for name, value in positive.items():
            if value <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {value}")
        for name in ("train_samples", "test_samples", "weight_decay", "seed", "server_epochs"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.seed > SEED_LIMIT:
            raise ConfigError(f"--seed must be a whole number in 0..{SEED_LIMIT}, got {self.seed}")
        if self.lr_schedule not in schedule.SCHEDULES:
            raise ConfigError(f"--lr-schedule: unknown schedule '{self.lr_schedule}', choose "
                              f"{', '.join(schedule.SCHEDULES)}")
        if not 0 <= self.warmup_rounds < self.rounds:
            raise ConfigError(f"--warmup-rounds must be in [0, --rounds) = [0, {self.rounds}), "
                              f"got {self.warmup_rounds}")
        if not 1 <= self.clients_per_round <= self.clients:
            raise ConfigError(f"--clients-per-round must be between 1 and --clients ({self.clients}), "
                              f"got {self.clients_per_round}")
        self._check_threat()
        if self.dataset in ("cifar10", "cifar100") and not self.data_dir:
            raise ConfigError(f"--dataset {self.dataset} needs --data-dir DIR (a local copy, or where to download it)")
        if self.data_dir and not Path(self.data_dir).is_dir():
            where = "is not a folder" if Path(self.data_dir).exists() else "does not exist"
            raise ConfigError(f"--data-dir {self.data_dir} {where}: create it or point to your dataset copy")
        self._check_canaries()

    def _check_precision(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision: unknown precision '{self.precision}', choose {', '.join(PRECISIONS)}")
        if self.precision != "fp32" and self.dp_eps > 0:
            raise ConfigError(f"--precision {self.precision} with --dp-eps: DP-SGD runs in fp32 (its clipping "
                              "bound needs exact per-sample norms); drop --precision or --dp-eps")

    def _check_canaries(self) -> None:
        if self.canary_kind not in CANARY_KINDS:
            raise ConfigError(f"--canary-kind: unknown kind '{self.canary_kind}', choose {', '.join(CANARY_KINDS)}")
        if self.canaries < 0:
            raise ConfigError(f"--canaries must be >= 0 (0: none), got {self.canaries}")
        if self.canaries and not self.record_truth:
            raise ConfigError("--canaries: their inclusion bits reach the auditor only through truth/; "
                              "drop --no-record-truth")
        if self.canaries:
            canary_set(self)  # CanaryError (a ConfigError) when the held-out pool is too small

    @property
    def client_lr(self) -> float:
        """--lr, or where it is not given (0) the method's own default: the PEFT methods want a larger rate."""
        return self.lr or method_spec(self.method).default_lr

    def lr_factor(self, round_number: int) -> float:
        """The factor of --lr and --server-lr in a round (1-based): --warmup-rounds, then --lr-schedule."""
        return schedule.lr_factor(round_number - 1, self.warmup_rounds, self.rounds, self.lr_schedule)

    def _check_head_pruning(self) -> None:
        for name, choices in (("head_pruning", HEAD_PRUNING), ("head_weighting", HEAD_WEIGHTING),
                              ("client_selection", CLIENT_SELECTION)):
            if getattr(self, name) not in choices:
                raise ConfigError(f"--{name.replace('_', '-')}: unknown value '{getattr(self, name)}', choose "
                                  f"{', '.join(choices)}")
        if not 0.0 <= self.head_sparsity < 1.0:
            raise ConfigError(f"--head-sparsity must be in [0, 1) (fraction of each layer's heads a client prunes; "
                              f"at least one is kept), got {self.head_sparsity}")
        if self.client_selection == "loss-gap" and self.dp_eps > 0:
            raise ConfigError("--client-selection loss-gap: with --dp-eps clients report no loss (it is not noised) "
                              "and no client can know its rounds in advance for its budget; use random")
        if self.client_selection == "loss-gap" and self.clients_per_round in (0, self.clients):
            raise ConfigError("--client-selection loss-gap picks --clients-per-round of the --clients: set "
                              f"--clients-per-round below {self.clients}")

    def _check_threat(self) -> None:
        if self.threat not in THREATS:
            raise ConfigError(f"--threat: unknown threat '{self.threat}', choose {', '.join(THREATS)}")
        if self.threat == "honest":
            if self.tamper or self.tamper_round:
                raise ConfigError("--tamper and --tamper-round need --threat malicious")
            return
        if self.tamper not in TAMPERINGS:
            raise ConfigError(f"--threat {self.threat} needs --tamper NAME, one of {', '.join(TAMPERINGS)}; "
                              f"got {self.tamper!r}")
        if self.federation != "simulation":
            raise ConfigError(f"--threat {self.threat} is for measuring attacks in simulation only: use "
                              "--federation simulation")
        if self.threat == "adaptive" and self.tamper_round:
            raise ConfigError("--tamper-round is for --threat malicious: an adaptive server drifts towards its "
                              "tampering every round")
        if not method_spec(self.method).uploads_features:
            uploading = ", ".join(m.name for m in methods_with("uploads_features"))
            raise ConfigError(f"--tamper targets the feature and head uploads; --method {self.method} uploads no "
                              f"features (methods that do: {uploading})")
        if not 0 <= self.tamper_round <= self.rounds:
            raise ConfigError(f"--tamper-round must be in 1..--rounds ({self.rounds}) or 0 (the last), "
                              f"got {self.tamper_round}")

    def _check_finite(self) -> None:
        """NaN and inf first: every comparison below is False for NaN (`nan > 0` skipped DP-SGD while the
        server calibrated noise for it), so no later check may see one."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", "float") and not math.isfinite(value):
                raise ConfigError(f"--{f.name.replace('_', '-')} must be a finite number, got {value}")

    def to_toml(self) -> str:
        return tomli_w.dumps(dataclasses.asdict(self))

    @classmethod
    def from_mapping(cls, values: dict, source: str) -> "TrainConfig":
        """Build from a mapping (a TOML file); keys may use - or _; unknown keys are an error."""
        known = {f.name: f for f in fields(cls)}
        kwargs = {}
        for key, value in values.items():
            name = key.replace("-", "_")
            if name not in known:
                raise ConfigError(f"{source}: unknown option '{key}'; known: {', '.join(known)}")
            kwargs[name] = _coerce(value, known[name].type, f"{source}: {key}")
        return cls(**kwargs)

    @classmethod
    def from_toml_file(cls, path: Path) -> "TrainConfig":
        return cls.from_mapping(read_toml(path, "config file"), str(path))


def read_toml(path: Path, what: str) -> dict:
    """A TOML file's content; a missing or malformed file is a ConfigError naming it ("config file PATH ...")."""
    if input_file_problem(Path(path)) == "is not a regular file":  # a device or a named pipe: read forever
        raise ConfigError(f"{what} {path} is not a regular file: give the TOML file itself")
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path} is a folder: give the TOML file itself") from None
    except OSError as exc:  # unreadable, or under a file
        raise ConfigError(f"{what} {path} cannot be read ({exc.strerror}): give a readable TOML file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what} {path} is not valid TOML: {exc}") from None


TOML_TYPE_NAMES = {"str": "a string", "bool": "true or false", "int": "a whole number", "float": "a number"}


def _coerce(value, type_name: str, where: str):
    expected = {"str": str, "bool": bool, "int": int, "float": (int, float)}[type_name]
    if isinstance(value, bool) and type_name != "bool" or not isinstance(value, expected):
        raise ConfigError(f"{where} must be {TOML_TYPE_NAMES[type_name]}, got {value!r}")
    return float(value) if type_name == "float" else value

"""The training configuration: one dataclass whose fields are declared options (eftguard.options), read from /
written to TOML, validated once."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path

import tomli_w

from eftguard import schedule
from eftguard.canaries import CANARY_KINDS, canary_set
from eftguard.data.registry import DATASET_HELP, check_dataset_name
from eftguard.errors import ConfigError
from eftguard.methods import METHODS as METHOD_SPECS, method_spec, methods_with
from eftguard.model import PRESETS, ModelError, check_local_layers, check_pretrained
from eftguard.options import SEED, Bound, above, at_least, check_values, from_mapping, option
from eftguard.paths import input_file_problem
from eftguard.precision import PRECISIONS
from eftguard.retention import KEEP_ROUNDS_HELP, STORE_DTYPES, Retention, parse_keep_clients, parse_keep_rounds
from eftguard.sampling import BALANCE_MODES

METHODS = tuple(METHOD_SPECS)
ACCOUNTANTS = ("prv", "rdp")  # opacus accountants that calibrate DP-SGD noise
FEDERATIONS = ("simulation", "deployment")
SERVER_ROWS = ("memory", "disk")  # where the server holds a round's feature rows (eftguard.federation.rows)
HEAD_PRUNING = ("importance", "random")  # headprune-lora: which heads a client keeps
HEAD_WEIGHTING = ("importance", "samples")  # headprune-lora: each head's average weighted by alpha_c or by n_k
CLIENT_SELECTION = ("random", "loss-gap")
# malicious: the server tampers with one round's model; adaptive: every round it moves each client's model towards
# the tampering as far as the clients' model check allows (attacks/tamper.py)
THREATS = ("honest", "malicious", "adaptive")
# --tamper: eftguard.attacks.tamper implements each
TAMPERINGS = ("identity-embed", "stealth-embed", "label-probe", "imprint", "class-fish", "feature-fish")
# the tamperings that read the parameter update (the rest read the feature and head uploads), and the parameter
# whose update they read: a method whose clients do not train it cannot take them
UPDATE_TAMPERINGS = {"imprint": "local_module.blocks.0.mlp.fc1.weight",
                     "class-fish": "local_module.patch_embed.proj.weight",
                     "feature-fish": "local_module.patch_embed.proj.weight"}
DP_EPS_LIMIT = 100.0  # above it e^epsilon bounds nothing, and the accountants' noise search does not end
DP_ROUNDS_LIMIT = 10_000  # with --dp-eps, every client's rounds are listed and accounted for before round 1
FRACTION = Bound(lambda value: 0.0 <= value < 1.0, "in [0, 1)")


def _local_layers(value: int) -> None:
    """The deepest preset's bound; validate() checks the chosen preset's."""
    try:
        check_local_layers(value, max(preset.depth for preset in PRESETS.values()))
    except ModelError as exc:
        raise ConfigError(str(exc)) from None


@dataclass
class TrainConfig:
    """Every knob of a training run, each declared once with its help, choices and bounds (eftguard.options):
    the flags of eftguard train, the keys of its TOML files and the check of each value are read from here;
    validate() adds the rules between options. Empty strings and zeros mean "not set" (TOML has no null)."""

    dataset: str = option("photos", f"dataset: {DATASET_HELP}", check=check_dataset_name)
    data_dir: str = option("", "folder with a local copy of the dataset (cifar10/cifar100 download there where the "
                               "network allows)")
    model: str = option("vit-tiny-32", "model preset: " + "; ".join(f"{name} ({preset.description})"
                                                                   for name, preset in PRESETS.items()),
                        choices=PRESETS, noun="preset")
    pretrained: bool = option(False, "start from timm's pretrained hub weights (needs the network or the hub cache)")
    checkpoint: str = option("", "start from local weights (.safetensors, or a state dict .pt/.pth); timm or eftguard "
                                 "layout")
    method: str = option("eftvit", "training method: " + "; ".join(f"{name} ({spec.description})"
                                                                   for name, spec in METHOD_SPECS.items()),
                         choices=METHOD_SPECS, noun="method")
    mask_ratio: float = option(0.75, "fraction of patch tokens each client drops per image, in [0, 1) (masked methods "
                                     "only)", bound=Bound(FRACTION.holds, "in [0, 1) (fraction of patches dropped)"))
    prompt_tokens: int = option(10, "fed-prompt: learned prompt tokens inserted after the cls token", bound=above(0))
    lora_rank: int = option(8, "fed-lora: rank r of the LoRA factors on each attention projection; headprune-lora: on "
                               "each head's part of them", bound=above(0))
    head_sparsity: float = option(0.9, "headprune-lora: fraction s of each layer's attention heads a client prunes, in "
                                       "[0, 1); it trains and uploads the LoRA of the other ceil((1 - s) * heads) (at "
                                       "least one)",
                                  bound=Bound(FRACTION.holds, "in [0, 1) (fraction of each layer's heads a client "
                                                              "prunes; at least one is kept)"))
    head_pruning: str = option("importance", "headprune-lora: which heads a client keeps: importance (the largest "
                                             "alpha, the mean over its images of the largest q.k / sqrt(d_h), on the "
                                             "received model) or random (the ablation)", choices=HEAD_PRUNING)
    head_weighting: str = option("importance", "headprune-lora: each head's factors averaged over the clients that "
                                               "kept it, weighted by their importance alpha_c / (sum alpha + 1e-8), or "
                                               "by their sample counts (samples: the ablation)", choices=HEAD_WEIGHTING)
    client_selection: str = option("random", "how --clients-per-round clients are picked: random (seeded), or loss-gap "
                                             "(round 1 random, then the clients whose last local training loss most "
                                             "exceeds the loss of the global model they received, on their data; "
                                             "never-seen clients first)", choices=CLIENT_SELECTION)
    local_layers: int = option(2, "M: transformer blocks in the client's local module (1..depth-1); the rest stay on "
                                  "the server", check=_local_layers)
    clients: int = option(8, "number of clients (data partitions)", bound=above(0))
    clients_per_round: int = option(0, "clients taking part in each round (0: all)")
    rounds: int = option(5, "federated rounds", bound=above(0))
    local_epochs: int = option(1, "client epochs per round (E)", bound=above(0))
    server_epochs: int = option(1, "server epochs on the uploaded features per round (S; 0: theta is never trained on "
                                   "them)", bound=at_least(0))
    batch_size: int = option(64, "batch size, clients and server", bound=above(0))
    lr: float = option(0.0, "client learning rate (AdamW); 0: the method's own default (docs/peft.md, learning rate "
                            "per method): " + ", ".join(f"{name} {spec.default_lr:g}"
                                                         for name, spec in METHOD_SPECS.items()),
                       bound=above(0))  # checked once resolved: 0 is the method's default_lr by then
    server_lr: float = option(1e-3, "server learning rate for the global module (AdamW)", bound=above(0))
    warmup_rounds: int = option(0, "rounds of linear learning-rate warm-up (client and server: round t of W uses t/W "
                                   "of the rate)")
    lr_schedule: str = option("constant", "after the warm-up, the client and server learning rates per round: "
                                          "constant, or cosine (decay toward 1% of the rate, reached one round after "
                                          "the last: the pretrain command's schedule, per round)",
                              choices=schedule.SCHEDULES, noun="schedule")
    weight_decay: float = option(0.05, "AdamW weight decay", bound=at_least(0))
    beta: float = option(0.1, "Dirichlet concentration of the non-IID split (small: few classes per client)",
                         bound=above(0))
    balance: str = option("median", "per-class target T of the feature upload: median, mean, max of the class counts, "
                                    "or none", choices=BALANCE_MODES, noun="mode")
    seed: int = option(0, "seed of everything random (init, split, masks, sampling)", bound=SEED)
    train_samples: int = option(2000, "use a seeded random subset of this many training images (0: all)",
                                bound=at_least(0))  # the default keeps a CPU run under 3 minutes
    test_samples: int = option(500, "evaluate on a seeded random subset of this many test images (0: all)",
                               bound=at_least(0))
    federation: str = option("simulation", "runtime: simulation (Flower's simulation engine on this machine) or "
                                           "deployment (a running SuperLink with one SuperNode per partition; see "
                                           "--superlink)", choices=FEDERATIONS, noun="runtime")
    cpus_per_client: float = option(1.0, "CPU cores reserved per simulated client (2 clients train in parallel on 2 "
                                         "cores)", bound=above(0))
    record_truth: bool = option(True, "ask clients for auditor-only ground truth (source sample ids, kept patches, "
                                      "class counts) that the server stores in truth/ for scoring attacks. A deployed "
                                      "node sends it only if started with --share-truth; simulated nodes follow this "
                                      "option. --no-record-truth when the server is not your auditor: the truth "
                                      "reveals each client's class histogram")
    encrypt_at_rest: str = option("", "KEYFILE: store uploads in observed/ encrypted (AES-256-GCM); a missing file "
                                      "gets a new random key (mode 0600). Attacks and reports then need the key")
    keep_rounds: str = option("all", "the rounds whose uploads and ground truth the run keeps for its auditor, with "
                                     "the checkpoints their attacks read (the final model always): " + KEEP_ROUNDS_HELP
                                     + ". The server trains on every upload either way "
                                       "(docs/run-directory.md#retention)",
                              check=parse_keep_rounds, metavar="ROUNDS")
    keep_clients: str = option("all", "the clients whose uploads and ground truth kept rounds keep: all, or N (a "
                                      "seeded sample of N clients, the same every round)",
                               check=parse_keep_clients, metavar="CLIENTS")
    store_uploads: str = option("float32", "the precision the uploads are kept in on disk for the auditor: float32, "
                                           "float16 or bfloat16 (half the bytes; the server trains on what was "
                                           "sent either way)", choices=STORE_DTYPES, noun="precision")
    server_rows: str = option("memory", "where the server holds a round's uploaded feature rows while theta trains on "
                                        "them: memory (every row twice: decoded and concatenated), or disk (spooled "
                                        "to RUN/tmp/ as each reply arrives and memory-mapped: one client's rows and "
                                        "one batch in memory; eftguard plan says which fits)",
                              choices=SERVER_ROWS, noun="place")
    secagg: bool = option(False, "secure aggregation (Flower's SecAgg+): the server learns only the cohort's "
                                 "weighted average parameter update, never one client's; metrics, and eftvit's patch "
                                 "features, still travel in the clear (docs/secagg.md)")
    round_timeout: float = option(3600.0, "seconds to wait for client replies in a round; late clients are dropped",
                                  bound=above(0))
    dp_eps: float = option(0.0, "end-to-end differential privacy: total epsilon per client over all the rounds it "
                                "takes part in, for everything it uploads (0: off): DP-SGD (Opacus) on the parameters "
                                "its method trains, and (eftvit) its patch features and labels as a Gaussian release "
                                "of every image per round, clipped to --feature-clip (docs/dp.md)",
                           bound=Bound(lambda value: 0 <= value <= DP_EPS_LIMIT,
                                       f"in [0, {DP_EPS_LIMIT:g}] (0: no DP-SGD; above {DP_EPS_LIMIT:g} the "
                                       "guarantee e^epsilon bounds nothing)"))
    dp_delta: float = option(0.0, "delta per client (0: 1 / (10 n_k), n_k the client's sample count)",
                             bound=Bound(FRACTION.holds, "in [0, 1) (0: 1 / (10 n) per client)"))
    max_grad_norm: float = option(1.0, "DP-SGD per-sample gradient clipping norm", bound=above(0))
    accountant: str = option("prv", "privacy accountant that calibrates the DP-SGD noise and reports epsilon: prv or "
                                    "rdp", choices=ACCOUNTANTS, noun="accountant")
    dp_feature_share: float = option(0.5, "fraction of --dp-eps for the feature channel (features, labels, row "
                                          "counts); the rest goes to DP-SGD on the parameters")
    feature_noise: float = option(0.0, "feature-release defense without --dp-eps (no epsilon claimed): Gaussian noise "
                                       "of std SIGMA * C added to every uploaded token feature after clipping (needs "
                                       "--feature-clip C; 0: clipping only)", bound=at_least(0))
    feature_clip: float = option(0.0, "without --dp-eps: clip every uploaded token feature to L2 norm C (0: off); with "
                                      "--dp-eps: the norm C each image's whole feature row is clipped to (0: 20)",
                                 bound=at_least(0))
    canaries: int = option(0, "M canaries for eftguard attack dp-audit, spread over the clients (seeded), each put "
                              "into its client's data with probability 1/2; the inclusion bits go to truth/ only (0: "
                              "none; docs/dp.md)", bound=Bound(lambda value: value >= 0, ">= 0 (0: none)"))
    canary_kind: str = option("mislabelled", "mislabelled (held-out images with a wrong label; every channel) or "
                                             "gradient (noise images for the parameter channel)",
                              choices=CANARY_KINDS, noun="kind")
    threat: str = option("honest", "honest; malicious: the server sends the tampering of its model in --tamper-round; "
                                   "adaptive: every round it sends each client the model closest to the tampering "
                                   "that the client's --model-check accepts (simulation only, to measure the "
                                   "tampering attacks and the check; docs/threat-model.md)", choices=THREATS,
                         noun="threat")
    tamper: str = option("", "the malicious server's tampering: " + "; ".join(TAMPERINGS), choices=TAMPERINGS)
    tamper_round: int = option(0, "the round whose model the malicious server tampers with (0: the last; not with "
                                  "adaptive)")
    model_check: bool = option(True, "simulated clients check every model they receive against the one they received "
                                     "before and refuse (upload nothing) a round whose model moved further than the "
                                     "run's local and server training can move it (defenses/model_check.py)")
    precision: str = option("fp32", "of every forward pass in training, feature extraction and evaluation: fp32, or "
                                    "bf16 (bfloat16 matrix products, float32 weights, optimizer and uploads; about "
                                    "2-2.5x faster where the CPU has AMX tiles or AVX-512 BF16, far slower where it "
                                    "has neither; not with --dp-eps; docs/training.md)", choices=PRECISIONS,
                            noun="precision")

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
        """Every option against its declaration (finite, choices, bounds), then the rules between options."""
        check_values(self)
        try:
            check_local_layers(self.local_layers, PRESETS[self.model].depth)
        except ModelError as exc:
            raise ConfigError(f"--model {self.model}: {exc}") from None
        try:
            check_pretrained(self.model, self.pretrained)
        except ModelError as exc:
            raise ConfigError(str(exc)) from None
        method = method_spec(self.method)
        self._check_client_selection()
        self._check_dp(method)
        self._check_feature_release(method)
        if not 0 <= self.warmup_rounds < self.rounds:
            raise ConfigError(f"--warmup-rounds must be in [0, --rounds) = [0, {self.rounds}), "
                              f"got {self.warmup_rounds}")
        if not 1 <= self.clients_per_round <= self.clients:
            raise ConfigError(f"--clients-per-round must be between 1 and --clients ({self.clients}), "
                              f"got {self.clients_per_round}")
        self._check_threat()
        self._check_secagg(method)
        if self.dataset in ("cifar10", "cifar100") and not self.data_dir:
            raise ConfigError(f"--dataset {self.dataset} needs --data-dir DIR (a local copy, or where to download it)")
        if self.data_dir and not Path(self.data_dir).is_dir():
            where = "is not a folder" if Path(self.data_dir).exists() else "does not exist"
            raise ConfigError(f"--data-dir {self.data_dir} {where}: create it or point to your dataset copy")
        self._check_canaries()
        Retention.of(self).check()

    def _check_dp(self, method) -> None:
        if self.precision != "fp32" and self.dp_eps > 0:
            raise ConfigError(f"--precision {self.precision} with --dp-eps: DP-SGD runs in fp32 (its clipping "
                              "bound needs exact per-sample norms); drop --precision or --dp-eps")
        if self.dp_eps > 0 and self.rounds > DP_ROUNDS_LIMIT:
            raise ConfigError(f"--rounds {self.rounds} with --dp-eps: each client's noise is calibrated for all its "
                              f"rounds before round 1, which does not end in reasonable time above {DP_ROUNDS_LIMIT} "
                              "rounds: lower --rounds")
        if self.dp_eps > 0 and not method.dp_sgd:
            private = ", ".join(m.name for m in methods_with("dp_sgd"))
            reason = f": {method.no_dp_reason}" if method.no_dp_reason else ""
            raise ConfigError(f"--dp-eps: --method {method.name} has no DP-SGD{reason} (methods with DP-SGD: "
                              f"{private})")

    def _check_feature_release(self, method) -> None:
        if self.dp_eps > 0 and method.uploads_features:
            if not 0 < self.dp_feature_share < 1:
                raise ConfigError(f"--dp-feature-share must be in (0, 1) (the feature channel's fraction of "
                                  f"--dp-eps), got {self.dp_feature_share}")
            if self.feature_noise > 0:
                raise ConfigError("--feature-noise: with --dp-eps the feature noise is calibrated to the budget; "
                                  "drop --feature-noise (--feature-clip sets the clipping norm)")
        if self.feature_noise > 0 and self.feature_clip == 0:
            raise ConfigError("--feature-noise is relative to the clipping norm: set --feature-clip C > 0 too")
        if self.feature_clip > 0 and not method.uploads_features:
            uploading = ", ".join(m.name for m in methods_with("uploads_features"))
            raise ConfigError(f"--feature-clip/--feature-noise apply to uploaded features; --method {method.name} "
                              f"uploads none (methods that do: {uploading})")

    def _check_secagg(self, method) -> None:
        if not self.secagg:
            return
        if method.no_secagg_reason:
            summed = ", ".join(m.name for m in METHOD_SPECS.values() if not m.no_secagg_reason)
            raise ConfigError(f"--secagg: --method {method.name} cannot be securely aggregated: "
                              f"{method.no_secagg_reason} (methods that can: {summed})")
        if self.clients_per_round < 2:
            raise ConfigError("--secagg needs --clients-per-round 2 or more: the sum of one client's update is "
                              "its update")
        if self.threat != "honest":
            raise ConfigError("--secagg with --threat: the tampering campaigns read each client's update; run them "
                              "without --secagg")

    def _check_canaries(self) -> None:
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

    def _check_client_selection(self) -> None:
        if self.client_selection == "loss-gap" and self.dp_eps > 0:
            raise ConfigError("--client-selection loss-gap: with --dp-eps clients report no loss (it is not noised) "
                              "and no client can know its rounds in advance for its budget; use random")
        if self.client_selection == "loss-gap" and self.clients_per_round in (0, self.clients):
            raise ConfigError("--client-selection loss-gap picks --clients-per-round of the --clients: set "
                              f"--clients-per-round below {self.clients}")

    def _check_threat(self) -> None:
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
        if self.tamper in UPDATE_TAMPERINGS:
            read = UPDATE_TAMPERINGS[self.tamper]
            if not method_spec(self.method).trains_parameter(read):
                training = ", ".join(m.name for m in METHOD_SPECS.values() if m.trains_parameter(read))
                raise ConfigError(f"--tamper {self.tamper} reads the update of {read}, which --method {self.method} "
                                  f"clients do not train (methods that do: {training})")
        elif not method_spec(self.method).uploads_features:
            uploading = ", ".join(m.name for m in methods_with("uploads_features"))
            raise ConfigError(f"--tamper targets the feature and head uploads; --method {self.method} uploads no "
                              f"features (methods that do: {uploading})")
        if not 0 <= self.tamper_round <= self.rounds:
            raise ConfigError(f"--tamper-round must be in 1..--rounds ({self.rounds}) or 0 (the last), "
                              f"got {self.tamper_round}")

    def to_toml(self) -> str:
        return tomli_w.dumps(dataclasses.asdict(self))

    @classmethod
    def from_mapping(cls, values: dict, source: str) -> "TrainConfig":
        """Build from a mapping (a TOML file); keys may use - or _; unknown keys are an error."""
        return cls(**from_mapping(cls, values, source))

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

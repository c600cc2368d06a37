#!/usr/bin/env bash
# Mutation check of eftguard's core (issue 16): mutmut 3.x, one module at a time, each against its own fast tests.
#
#   bash experiments/mutation.sh                # every core module, in the order below
#   bash experiments/mutation.sh sampling dp    # only these
#   MUTANTS="NAME ..." bash experiments/mutation.sh server   # only these mutants of a module (mutmut's names, globs:
#     MUTANTS="eftguard.federation.server.x_run_round__mutmut_*" for one function's)
#   bash experiments/mutation.sh server server_rounds   # server.py: its units, then whole rounds on what they left
#
# Each module is mutated in a scratch copy of the working tree (mutation-work/NAME, git-ignored), laid out as
# `pip install .` lays eftguard out (attacks/ and defenses/ inside eftguard/, so eftguard.defenses.dp is the
# mutated copy, not the checkout's), so the checkout is never touched and the per-module mutmut config lives only
# there. One worker, one thread:
# the check is meant to run beside other work on a 2-core machine. Results: mutation-work/NAME/results.txt
# (every mutant that was not killed), survivors.diff (their diffs) and a summary line per module on stdout.
# Needs: pip install 'mutmut>=3.8,<4' (a tool for developers, not a project dependency).
set -euo pipefail

cd "$(git rev-parse --show-toplevel)"
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
unset PYTHONPATH  # mutmut puts its mutated copy first on sys.path; nothing may shadow it

# tests/test_ledger.py's tests through whole rounds (the real ClientApp over the in-process grid): seconds each,
# rerun for every mutant they reach; the ledger is mutated against the rest of the file, which calls it directly
LEDGER_ROUNDS=(
  --deselect=tests/test_ledger.py::test_a_ledger_shortened_between_rounds_is_refused_and_no_reported_epsilon_falls_below_the_truth
  --deselect=tests/test_ledger.py::test_deployed_node_without_a_secret_draws_noise_the_server_cannot_regenerate
  --deselect=tests/test_ledger.py::test_dp_eps_zero_for_a_dp_run_is_refused
  --deselect=tests/test_ledger.py::test_dp_report_that_claims_less_than_the_run_is_dropped
  --deselect=tests/test_ledger.py::test_dp_run_records_the_clients_own_spend_and_drops_a_client_without_dp
  --deselect=tests/test_ledger.py::test_ground_truth_is_encrypted_at_rest
  --deselect=tests/test_ledger.py::test_hostile_run_id_cannot_escape_the_ledger_folder
  --deselect=tests/test_ledger.py::test_invalid_dp_request_is_refused_not_read_as_no_dp
  --deselect=tests/test_ledger.py::test_lowering_the_noise_is_refused
  --deselect=tests/test_ledger.py::test_node_ceiling_caps_the_run_and_refuses_rounds_without_dp
  --deselect=tests/test_ledger.py::test_node_that_does_not_share_truth_sends_none_and_the_round_goes_on
  --deselect=tests/test_ledger.py::test_non_dp_run_never_records_an_epsilon
  --deselect=tests/test_ledger.py::test_raising_dp_eps_mid_run_is_refused
  --deselect=tests/test_ledger.py::test_resent_round_is_spent_again_with_fresh_noise
  --deselect=tests/test_ledger.py::test_run_directory_with_nan_dp_eps_is_refused_before_any_round
  --deselect=tests/test_ledger.py::test_server_resuming_after_a_client_trained_resends_the_round_and_the_client_refuses
  --deselect=tests/test_ledger.py::test_torn_ledger_file_is_an_error_naming_it_not_a_fresh_budget
)

# tests/test_client.py's first five tests (rounds of 200 images over 4 clients) were never in the client's
# selection: the client is mutated against the rest of the file, its functions called directly, and against
# tests/test_model_check.py (the node's model check: its one whole run, 4 rounds of the micro ViT, takes 2-3 s)
CLIENT_ROUNDS=(
  --deselect=tests/test_client.py::test_eftvit_client_upload_is_valid_and_truthful
  --deselect=tests/test_client.py::test_client_round_is_a_pure_function_of_its_inputs
  --deselect=tests/test_client.py::test_fedavg_client_uploads_whole_model_and_no_features
  --deselect=tests/test_client.py::test_node_started_for_another_federation_is_refused
  --deselect=tests/test_client.py::test_client_clips_uploaded_features_when_asked
)

# tests/test_server.py's runs end to end (several rounds each, some module-scoped) and the round record's test (a
# round of real clients): in no selection. Its test of loading the average is in the server's.
SERVER_RUNS=(
  --deselect=tests/test_server.py::test_bad_upload_is_dropped_and_the_round_goes_on
  --deselect=tests/test_server.py::test_checkpoint_holds_the_fedavg_of_the_uploads_and_a_trained_global_module
  --deselect=tests/test_server.py::test_dp_run_records_epsilon_per_client_within_budget
  --deselect=tests/test_server.py::test_dp_run_with_feature_noise_resumes_exactly
  --deselect=tests/test_server.py::test_fedavg_method_checkpoint_is_the_weighted_average_of_whole_models
  --deselect=tests/test_server.py::test_missing_partition_is_a_clear_error
  --deselect=tests/test_server.py::test_resumed_run_equals_uninterrupted_run
  --deselect=tests/test_server.py::test_rounds_write_the_run_directory
  --deselect=tests/test_server.py::test_stop_request_ends_the_run_after_a_completed_round
  --deselect=tests/test_server.py::test_uploads_encrypted_at_rest_need_the_key
  --deselect=tests/test_server.py::test_without_truth_recording_no_ground_truth_leaves_the_clients
  --deselect=tests/test_server.py::test_round_record_reports_the_clients_weighted_mean_loss_and_their_counts
  --deselect=tests/test_server.py::test_server_epochs_zero_leaves_theta_as_initialised
)
# its whole rounds pinned on exact values: in the server's selection, not the records'
SERVER_PINNED_ROUNDS=(
  --deselect=tests/test_server.py::test_client_without_a_reply_is_dropped_as_late
  --deselect=tests/test_server.py::test_dp_client_reporting_less_than_it_must_is_dropped_through_the_round
  --deselect=tests/test_server.py::test_dp_round_sends_each_client_its_noise_and_records_what_it_reports
  --deselect=tests/test_server.py::test_eftvit_rounds_average_phi_and_h_and_train_theta_on_the_uploaded_features
  --deselect=tests/test_server.py::test_fedavg_method_round_averages_the_whole_model_and_trains_nothing_on_the_server
  --deselect=tests/test_server.py::test_finished_run_is_not_served_again
  --deselect=tests/test_server.py::test_invalid_reply_is_dropped_with_its_reason_and_the_round_averages_the_others
  --deselect=tests/test_server.py::test_only_the_selected_clients_are_sent_the_round_and_averaged
  --deselect=tests/test_server.py::test_progress_shows_each_rounds_clients_and_server_training
  --deselect=tests/test_server.py::test_resumed_run_equals_the_uninterrupted_run
  --deselect=tests/test_server.py::test_round_record_reports_each_clients_seconds_and_the_weighted_loss
  --deselect=tests/test_server.py::test_round_without_a_valid_reply_keeps_the_model_and_the_run_goes_on
  --deselect=tests/test_server.py::test_run_encrypted_at_rest_is_served_with_its_key
  --deselect=tests/test_server.py::test_run_from_a_checkpoint_starts_from_its_weights
  --deselect=tests/test_server.py::test_run_of_an_adapted_model_resumes_from_its_checkpoint
  --deselect=tests/test_server.py::test_stop_request_after_a_round_sends_no_further_round
  --deselect=tests/test_server.py::test_stop_request_during_a_round_keeps_no_part_of_it
  --deselect=tests/test_server.py::test_too_few_nodes_is_a_clear_error_within_the_round_timeout
  --deselect=tests/test_server.py::test_truth_sent_to_a_run_that_does_not_record_it_is_dropped
  --deselect=tests/test_server.py::test_without_server_epochs_theta_stays_as_sent
)
# the round's features pinned in other subjects' files, a whole run each (about a second): client selection by loss
# gap, head-pruned LoRA's per-head averages, server rows spooled to disk, a tampering and an adaptive server's rounds,
# a refusing DP node's spend recorded (SecAgg+'s rounds: tests/test_secagg.py, 9 s in all)
ROUND_FEATURES=(
  tests/test_headprune.py::test_loss_gap_selection_picks_the_unseen_client_then_the_largest_reported_gap
  tests/test_headprune.py::test_clients_upload_only_their_kept_heads_and_the_server_averages_each_head_by_importance
  tests/test_headprune.py::test_weighting_by_samples_and_random_pruning_are_the_ablations
  tests/test_retention.py::test_rows_spooled_to_disk_train_the_same_model_as_rows_in_memory
  tests/test_malicious.py::test_a_label_probe_round_gives_the_class_counts_away
  tests/test_model_check.py::test_an_adaptive_server_stays_within_every_bound_and_moves_as_far_as_they_allow
  tests/test_ledger.py::test_server_resuming_after_a_client_trained_resends_the_round_and_the_client_refuses
)
# tests/test_server.py's hostile replies: the 203 through parse_reply are in the server's and the records'
# selections, its other tests (whole runs, and the generator's own check) in none
HOSTILE_RUNS=(
  --deselect=tests/test_server.py::test_the_generator_covers_the_space
  --deselect=tests/test_server.py::test_hostile_clients_are_dropped_and_the_honest_one_decides_every_round
  --deselect=tests/test_server.py::test_malformed_metrics_and_an_all_nan_round_do_not_stop_the_run
  --deselect=tests/test_server.py::test_a_client_claiming_2_62_examples_does_not_set_the_model
  --deselect=tests/test_server.py::test_finite_but_absurd_values_are_refused
  --deselect=tests/test_server.py::test_a_12_gib_feature_upload_is_refused_without_decoding
  --deselect=tests/test_server.py::test_truth_with_extra_keys_or_foreign_sample_ids_is_refused
)

# name | file to mutate | its own fast tests (pytest arguments or node ids, -m "not slow" is always added)
MODULES=(
  "sampling|eftguard/sampling.py|tests/test_sampling.py"
  "masking|eftguard/masking.py|tests/test_masking.py tests/test_training.py tests/test_dp_clipping.py"
  "aggregate|eftguard/aggregate.py|tests/test_aggregate.py"
  "feature_noise|defenses/feature_noise.py|tests/test_feature_noise.py"
  "metrics|eftguard/metrics.py|tests/test_metrics.py tests/test_identifiability.py"
  "training|eftguard/training.py|tests/test_training.py tests/test_precision.py tests/test_dp_clipping.py tests/test_model.py tests/test_dp.py tests/test_sampling.py tests/test_dp_server_training.py --deselect=tests/test_model.py::test_paper_preset_splits_like_timm"
  "validation|eftguard/federation/validation.py|tests/test_validation.py tests/test_server.py::test_every_hostile_reply_is_rejected_with_a_reason_and_the_honest_one_passes tests/test_headprune.py::test_a_hostile_head_record_or_update_is_refused_with_a_reason"
  "dp|defenses/dp.py|tests/test_dp.py tests/test_feature_dp.py::test_both_channels_are_calibrated_jointly_to_spend_the_budget_asked_for tests/test_feature_dp.py::test_ledger_holds_the_composed_total_not_a_split tests/test_training.py tests/test_dp_clipping.py"
  "clipping|defenses/clipping.py|tests/test_dp.py tests/test_dp_clipping.py tests/test_training.py tests/test_peft.py::test_the_dp_step_of_each_peft_method_is_the_mean_of_its_clipped_per_sample_gradients"
  "ledger|defenses/ledger.py|tests/test_ledger.py ${LEDGER_ROUNDS[*]}"
  "at_rest|defenses/at_rest.py|tests/test_at_rest.py"
  "node_auth|defenses/node_auth.py|tests/test_node_auth.py"
  "tls|defenses/tls.py|tests/test_tls.py tests/test_node_auth.py"
  "records|eftguard/federation/records.py|tests/test_server.py ${SERVER_RUNS[*]} ${SERVER_PINNED_ROUNDS[*]} ${HOSTILE_RUNS[*]} --deselect=tests/test_server.py::test_the_average_is_loaded_with_strict_keys"
  # server.py in two passes: its functions called directly; then what that leaves alive against the whole rounds
  # pinned on exact values (the micro ViT, about 1 s each: against every mutant, 10-60 s per survivor of 1500)
  "server|eftguard/federation/server.py|tests/test_server.py tests/test_validation.py ${SERVER_RUNS[*]} ${HOSTILE_RUNS[*]} ${SERVER_PINNED_ROUNDS[*]} tests/test_dp_server_training.py tests/test_secagg.py"
  "server_rounds|eftguard/federation/server.py|${SERVER_PINNED_ROUNDS[*]//--deselect=/} ${ROUND_FEATURES[*]} tests/test_secagg.py|after:server"
  "client|eftguard/federation/client.py|tests/test_client.py ${CLIENT_ROUNDS[*]} tests/test_model_check.py"
  "apps|eftguard/federation/apps.py|tests/test_apps.py"
  "fleet_gateway|eftguard/federation/fleet_gateway.py|tests/test_fleet_gateway.py tests/test_deployment.py::test_fleet_gateway_forwards_only_fleet_calls"
  "deployment|eftguard/federation/deployment.py|tests/test_deployment.py"
)

command -v mutmut >/dev/null || { echo "mutation.sh: error: mutmut is not installed: pip install 'mutmut>=3.8,<4'" >&2; exit 2; }
wanted=("$@")
for entry in "${MODULES[@]}"; do
  IFS='|' read -r name file tests mutants <<<"$entry"  # mutants: after:NAME, those pass NAME left (MUTANTS overrides)
  if ((${#wanted[@]})) && [[ " ${wanted[*]} " != *" $name "* ]]; then continue; fi
  if [[ $mutants == after:* && -z ${MUTANTS:-} ]]; then
    before=${mutants#after:} && earlier=mutation-work/$before/results.txt
    [[ -f $earlier ]] || { echo "$name: run $before first (no $earlier)" >&2; continue; }
    mutants=$(sed -nE 's/^ *([^ ]+): (survived|no tests|timeout)$/\1/p' "$earlier" | tr '\n' ' ')
    [[ -n $mutants ]] || { echo "$name: $before left no mutant alive"; continue; }
  fi
  work="mutation-work/$name"
  rm -rf "$work" && mkdir -p "$work"
  git ls-files -co --exclude-standard -z eftguard defenses attacks tests pyproject.toml | xargs -0 cp --parents -t "$work"
  mv "$work/attacks" "$work/defenses" "$work/eftguard/"
  installed=eftguard/${file#eftguard/}  # defenses/dp.py -> eftguard/defenses/dp.py
  {
    printf '[mutmut]\nsource_paths =\n    eftguard\nonly_mutate = %s\n' "$installed"
    # -n 0: in mutmut's own process, where it records which tests call which function (pyproject.toml asks for
    # two pytest-xdist workers)
    printf 'pytest_add_cli_args =\n    -q\n    -p\n    no:cacheprovider\n    -n\n    0\n    -m\n    not slow\n'
    printf 'pytest_add_cli_args_test_selection =\n'
    for t in $tests; do [[ -e ${t%%::*} || $t == -* ]] && printf "    %s\n" "$t"; done
  } >"$work/setup.cfg"
  start=$SECONDS
  (cd "$work" && mutmut run --max-children 1 ${MUTANTS:-$mutants} >run.log 2>&1) || { echo "$name: mutmut failed, see $work/run.log" >&2; continue; }
  (
    cd "$work"
    mutmut results >results.txt 2>&1
    mutmut export-cicd-stats >/dev/null
  )
  python3 experiments/mutation_survivors.py "$work" "$installed" >"$work/survivors.diff"
  python3 - "$work/mutants/mutmut-cicd-stats.json" "$name" $((SECONDS - start)) <<'PY'
import json, sys
stats, name, seconds = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
print(f"{name:14} generated {stats['total']:4}  killed {stats['killed']:4}  survived {stats['survived']:3}  "
      f"timeout {stats['timeout']:2}  no tests {stats['no_tests']:2}  ({seconds} s)")
PY
done

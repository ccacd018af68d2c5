#!/bin/sh
# An agent that is a shell script (curl + jq): one chat completion, the task's prompt as the
# user message; the response JSON is its stdout. docs/agents.md.
set -eu
prompt=$(jq -c '.prompt')
curl -sS --fail-with-body -X POST "$OPENAI_BASE_URL/chat/completions" \
  -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" \
  -d "{\"model\": \"$OPENAI_MODEL\", \"messages\": [{\"role\": \"user\", \"content\": $prompt}]}"

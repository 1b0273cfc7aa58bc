#!/bin/sh
# A demo agent for deploy/compose.yaml: proposes through the admin API with its agent
# token (OPGATE_API_URL, OPGATE_TOKEN), about two operations a second, forever. Some
# proposals repeat (opgate answers them from the ledger), and every 20th is a write-off
# that waits for an operator in the console's approval queue.
set -u
until opgate ops list --limit 1 >/dev/null 2>&1; do sleep 2; done
i=0
while true; do
  i=$((i + 1))
  order="order_$((i % 50))"
  opgate propose --tool capture_payment --entity "order:$order" \
    --args "{\"amount\": \"$((i % 7 + 1)).00\", \"currency\": \"usd\"}" >/dev/null 2>&1
  opgate propose --tool send_email --entity "user:user_$((i % 30))" \
    --workflow-id "wf-$((i / 3))" --step 1 \
    --args "{\"to\": \"user$((i % 30))@example.com\", \"template\": \"welcome\"}" >/dev/null 2>&1
  if [ $((i % 20)) -eq 0 ]; then
    opgate propose --tool write_off_balance --entity "account:acct_$i" \
      --args '{"amount": "120.00", "currency": "usd"}' >/dev/null 2>&1
  fi
  sleep 1
done

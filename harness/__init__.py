"""The game-day harness: stack, client, puppet model, nemesis, history, checkers, measure."""

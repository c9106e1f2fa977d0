"""The generator (Jepsen's fifth role): what happens when, in a game day nobody scripted.

* `schedule`: a seeded schedule of operations by the game day's people (kills, resumes, new
  tasks, triggers, heartbeat fires, wakes, task changes) interleaved with faults, as plain
  data that goes into the journal and replays exactly;
* `faults`: the registry of named fault actions the schedule draws from;
* `play`: runs a schedule on a game day, every operation through the recording client;
* `shrink`: delta debugging of a failing schedule down to a minimal one that still fails;
* `random_day`: a random game day as pytest runs it: its schedules, the soak's counts, and a
  failure's shrunk schedule with the commands that replay it.
"""

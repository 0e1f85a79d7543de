"""Control: what handles incoming commands and writes hardware or kills on request.

Modules: auth (tokens, and when reads need one), access (what every API route checks
first: caller, read policy, path names, a registered provider), actions (the registry of
providers the API's actions call, and their errors), engine_actions and profile_actions
(the providers for the engine watchdog and the profile runtime), confirm (the revert
window of an apply), bodies (POST bodies, parsed after auth), audited (one mutating call,
its audit record first), routes (the POST routes under `/v1/`).
"""

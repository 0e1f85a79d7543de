"""Control: what handles incoming commands and writes hardware or kills on request.

Modules: auth (tokens, and when reads need one), actions (the registry of providers the
API's actions call, and their errors), engine_actions and profile_actions (the providers
for the engine watchdog and the profile runtime), confirm (the revert window of an apply).
"""

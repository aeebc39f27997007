"""Test helpers shared by the test tiers: real components only (no fakes of Redis or Envoy)."""

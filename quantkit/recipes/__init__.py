"""Recipes: one YAML file for the whole job, its schema, the staged run with its cache, the report with gates."""

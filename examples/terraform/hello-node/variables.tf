variable "greeting" {
  type    = string
  default = "hello"
}

variable "db_dsn" {
  type      = string
  sensitive = true
  default   = "postgres://notes:tf-fixture-pw-4a7c@db.internal:5432/notes"
}

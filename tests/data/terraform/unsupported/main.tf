variable "word" {
  default = "hey"
}

locals {
  level = "debug"
}

resource "sless_function" "ok" {
  name       = "ok-py"
  runtime    = "python3.11"
  entrypoint = "handler.main"
  source_dir = "${path.module}/code/ok"
  env_vars = {
    WORD  = var.word
    SHOUT = upper(var.word)
    LEVEL = local.level
    PHASE = sless_job.warm.phase
    SUM   = 1 + 2
  }
}

resource "sless_trigger" "ok_http" {
  name     = "ok-http"
  type     = "http"
  function = sless_function.ok.name
}

resource "sless_job" "warm" {
  name       = "ok-warm"
  function   = sless_function.ok.name
  event_json = jsonencode({ n = 1 })
  run_id     = 0
}

resource "sless_function" "many" {
  count      = 2
  name       = "many-${count.index}"
  runtime    = "python3.11"
  entrypoint = "handler.main"
  source_dir = "${path.module}/code/ok"
}

module "extra" {
  source = "./modules/extra"
}

resource "aws_s3_bucket" "assets" {
  bucket = "assets"
}

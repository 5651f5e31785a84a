terraform {
  required_providers {
    sless = {
      source  = "example/sless"
      version = "~> 1.0"
    }
  }
}

provider "sless" {
  endpoint = "http://sless-operator.sless-system:8080"
}

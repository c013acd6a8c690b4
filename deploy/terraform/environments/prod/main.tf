# Production: the image-crawler module on existing Kafka and Redis.
#   terraform init -backend-config=backend.hcl   # bucket, key, region of the state
#   terraform apply -var-file=prod.tfvars         # see terraform.tfvars.example

terraform {
  required_version = ">= 1.5"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = "~> 5.0"
    }
  }
  backend "s3" {}
}

provider "aws" {
  region = var.region
  default_tags {
    tags = { Project = "image-crawler", Environment = "prod" }
  }
}

module "image_crawler" {
  source = "../../modules/image-crawler"

  name                  = "image-crawler-prod"
  vpc_id                = var.vpc_id
  subnet_ids            = var.subnet_ids
  image_registry        = var.image_registry
  image_tag             = var.image_tag
  redis_url             = var.redis_url
  kafka_hosts           = var.kafka_hosts
  s3_bucket             = var.s3_bucket
  sources_url           = var.sources_url
  crawl_user_agent      = var.crawl_user_agent
  worker_count          = var.worker_count
  worker_instance_type  = var.worker_instance_type
  monitor_instance_type = "t3.small"
  url_partitions        = var.url_partitions
  operator_cidr_blocks  = var.operator_cidr_blocks
  ssm_environment       = var.ssm_environment
}

# Let the fleet into the existing Redis and Kafka (by security group, not CIDR).
locals {
  data_store_access = {
    for pair in setproduct(["monitor", "worker"], ["redis", "kafka"]) : "${pair[0]}-${pair[1]}" => {
      from_group = module.image_crawler.security_group_ids[pair[0]]
      to_group   = pair[1] == "redis" ? var.redis_security_group_id : var.kafka_security_group_id
      port       = pair[1] == "redis" ? var.redis_port : var.kafka_port
    }
  }
}

resource "aws_vpc_security_group_ingress_rule" "data_stores" {
  for_each                     = local.data_store_access
  description                  = "image-crawler ${each.key}"
  security_group_id            = each.value.to_group
  referenced_security_group_id = each.value.from_group
  ip_protocol                  = "tcp"
  from_port                    = each.value.port
  to_port                      = each.value.port
}

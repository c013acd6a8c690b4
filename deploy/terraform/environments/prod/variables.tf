variable "region" {
  description = "AWS region of the fleet."
  type        = string
  default     = "us-east-1"
}

variable "vpc_id" {
  type = string
}

variable "subnet_ids" {
  description = "Private subnets with a NAT gateway."
  type        = list(string)
}

variable "image_registry" {
  description = "e.g. 123456789012.dkr.ecr.us-east-1.amazonaws.com"
  type        = string
}

variable "image_tag" {
  description = "Release to run, e.g. the git commit the images were built from."
  type        = string
}

variable "redis_url" {
  description = "Redis endpoint, e.g. rediss://crawler.xxxxxx.use1.cache.amazonaws.com:6379/0 (a URL with a password goes in ssm_environment)."
  type        = string
}

variable "redis_security_group_id" {
  description = "Security group of the Redis cluster; the fleet is allowed in on redis_port."
  type        = string
}

variable "redis_port" {
  type    = number
  default = 6379
}

variable "kafka_hosts" {
  description = "Kafka bootstrap servers, e.g. b-1.crawler.kafka.us-east-1.amazonaws.com:9092,b-2..."
  type        = string
}

variable "kafka_security_group_id" {
  description = "Security group of the Kafka brokers; the fleet is allowed in on kafka_port."
  type        = string
}

variable "kafka_port" {
  type    = number
  default = 9092
}

variable "url_partitions" {
  description = "Partitions of the urls topic: about 8 per worker the fleet may grow to."
  type        = number
  default     = 256
}

variable "s3_bucket" {
  type    = string
  default = "cc-image-analysis"
}

variable "sources_url" {
  description = "Source sizes for the computed rate limits; null: the Openverse stats endpoint."
  type        = string
  default     = null
}

variable "crawl_user_agent" {
  description = "User-Agent with a contact URL; null: the crawler's default."
  type        = string
  default     = null
}

variable "worker_count" {
  type    = number
  default = 8
}

variable "worker_instance_type" {
  type    = string
  default = "c6i.large"
}

variable "operator_cidr_blocks" {
  description = "Operators' VPN and Prometheus networks allowed to the monitor's dashboard and /metrics."
  type        = list(string)
}

variable "ssm_environment" {
  description = "Settings read from SSM Parameter Store at boot, e.g. { REDIS_URL = \"/image-crawler/prod/redis-url\" }."
  type        = map(string)
  default     = {}
}
